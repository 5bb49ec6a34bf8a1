"""shardwork.moe_router — not built yet; see the package README for what it will hold."""
