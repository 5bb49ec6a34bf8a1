"""``python -m shardwork.trainer`` (e.g. under torchrun) is ``shardwork-train``."""

from shardwork.trainer.cli import quiet_cpu_threads, train_main

quiet_cpu_threads()

if __name__ == "__main__":
    raise SystemExit(train_main())
