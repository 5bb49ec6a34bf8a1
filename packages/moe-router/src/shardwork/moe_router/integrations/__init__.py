"""shardwork's router inside other frameworks' models, one submodule per framework.

Each submodule needs its framework installed (an optional extra of shardwork-moe-router) and
raises ImportError naming the extra when it is missing; importing this package needs nothing.

- :mod:`.transformers`: ``swap_routers(model, **options)`` for transformers 5 MoE models.
"""
