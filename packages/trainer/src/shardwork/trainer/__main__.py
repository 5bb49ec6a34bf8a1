"""``python -m shardwork.trainer`` (e.g. under torchrun) is ``shardwork-train``."""

from shardwork.trainer.cli import train_main
from shardwork.trainer.cpu_runtime import set_cpu_runtime_env

set_cpu_runtime_env()

if __name__ == "__main__":
    raise SystemExit(train_main())
