"""The launcher's variables (`config.launch_env`) and who reports a mistake (`errors`).

The catalogue in tests-integration/test_bad_input.py runs the CLI on the common mistakes;
these cover every rule once, each against the environment torchrun would give."""

import pytest

from shardwork.trainer.config.launch_env import launch_problems, launch_world_size
from shardwork.trainer.config.load import ConfigError
from shardwork.trainer.errors import is_reporting_rank

# What torchrun --nnodes 2 --nproc-per-node 4 gives the second process of the second node.
TORCHRUN = dict(WORLD_SIZE="8", RANK="5", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                MASTER_ADDR="node0", MASTER_PORT="29500")  # fmt: skip


def test_what_torchrun_sets_and_no_launcher_at_all_are_accepted():
    assert launch_problems(TORCHRUN) == (8, [])
    assert launch_problems({}) == (1, [])
    # one process with the variables spelled out needs no rendezvous address
    assert launch_problems({"WORLD_SIZE": "1", "RANK": "0"}) == (1, [])


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not valid; valid: an integer >= 1"),
        ({"WORLD_SIZE": "8.0"}, "WORLD_SIZE='8.0' is not valid"),
        ({"RANK": "-1"}, "RANK='-1' is not valid; valid: an integer >= 0"),
        ({"RANK": "8"}, "RANK=8 is not valid for WORLD_SIZE=8; valid: 0..7"),
        ({"RANK": None}, "WORLD_SIZE=8 but RANK is not set"),
        ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 is not valid for LOCAL_WORLD_SIZE=4; valid: 0..3"),
        ({"LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not valid"),
        ({"LOCAL_WORLD_SIZE": "16"}, "LOCAL_WORLD_SIZE=16 is more than WORLD_SIZE=8"),
        ({"MASTER_ADDR": " "}, "MASTER_ADDR is not set"),
        ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
        ({"MASTER_PORT": "65536"}, "MASTER_PORT='65536' is not valid; valid: a TCP port, 1..65535"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT='0' is not valid"),
    ],
)
def test_each_rule_names_the_variable_and_what_is_valid(change, problem):
    env = {k: v for k, v in {**TORCHRUN, **change}.items() if v is not None}
    _, problems = launch_problems(env)
    assert len(problems) == 1 and problems[0].startswith(problem), problems
    with pytest.raises(ConfigError) as info:
        launch_world_size(env)
    message = str(info.value)
    assert f"environment: {problem}" in message and "torchrun" in message


@pytest.mark.parametrize(
    "env, reports",
    [
        ({"RANK": "0", "TORCHELASTIC_RUN_ID": "r"}, True),
        ({"RANK": "1", "TORCHELASTIC_RUN_ID": "r"}, False),  # rank 0 of the job reports
        ({"RANK": "1"}, True),  # started by hand: its own terminal, rank 0 may not exist
        ({"RANK": "one", "TORCHELASTIC_RUN_ID": "r"}, True),  # nobody else can be sure to
        ({}, True),
    ],
)
def test_who_reports_a_mistake(monkeypatch, env, reports):
    for name in ("RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert is_reporting_rank() is reports
