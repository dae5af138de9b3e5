"""speculator's predictors, without workspaces (the package's modules, mirrored)."""
