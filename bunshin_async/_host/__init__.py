"""The host interface: the kernel (cgroups, mounts, /proc facts), CRIU, the workspaces' user namespace, the
security boundary, host-side tree walks, the agent protocol and its host client, where state lives on the host
and the snapshot store. One interface per external system; nothing here knows a workspace's facade."""
