"""Workspace images: the content-addressed layer store, OCI and ``docker save`` archives, the local Docker
engine, and ``Image``, the read-only root a workspace's overlay stacks on. Above the host interface only."""
