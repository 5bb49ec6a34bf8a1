"""shardwork.dist_checkpoint — not built yet; see the package README for what it will hold."""
