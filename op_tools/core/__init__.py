"""The engine that intercepts calls: OpTool, targeting, backward hooks, module paths, apply_feature."""
