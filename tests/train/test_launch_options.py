"""`pipeline train` / `pipeline run` options: nothing unknown reaches axolotl (issue 27.1), the same
training options on both commands (27.4), arguments after `--` classified by the launchers' own parsers."""

from __future__ import annotations

import click
import pytest
import typer
from typer.testing import CliRunner

from pipeline.errors import UsageError
from pipeline.train.launch import launcher_command, training_setup
from pipeline.train.passthrough import split_passthrough
from tests.support.helpers import REPO

TINY = REPO / "axolotl_configs" / "tiny-cpu.yml"


def _invoke(*args):
    from pipeline.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--lerning-rate", "0.001"],
            "No such option: --lerning-rate",
        ),  # the reported typo: trained at 0.002
        (["--nmae", "x"], "No such option: --nmae"),
        (["stray.yml"], "unexpected argument(s) stray.yml"),
        (["--", "--lerning-rate", "0.001"], "did you mean the axolotl key `learning_rate`"),
        (["--", "--num_processes", "2"], "the python launcher takes none"),  # python ignores launcher args
        (
            ["--gpus", "2", "--", "--num_proceses", "2"],
            "did you mean the accelerate option `--num_processes`",
        ),
        (["--gpus", "2", "--launcher", "python"], "--launcher python runs one process"),
        (["--strategy", "ddp"], "only for several processes"),
    ],
)
def test_train_refuses_what_would_be_forwarded_or_ignored(project, tiny_base, args, words):
    res = _invoke("train", str(TINY), "--set", f"base_model={tiny_base}", "--no-progress", *args)
    assert res.exit_code == 2, res.output
    assert words in res.output, res.output
    assert not project.train.runs_dir.exists() or not any(project.train.runs_dir.iterdir())


def test_run_refuses_the_same(project, tiny_base):
    for args, words in ((["--lerning-rate", "1"], "No such option"), (["--", "--nmae", "x"], "neither")):
        res = _invoke("run", str(TINY), "--set", f"base_model={tiny_base}", *args)
        assert res.exit_code == 2 and words in res.output, res.output


def test_after_dashdash_config_keys_become_checked_overrides(tmp_path):
    tc, plan = training_setup(
        TINY, [f"base_model={tmp_path}"], launcher_args=["--learning-rate", "0.001", "--max_steps=3"]
    )
    assert tc.data["learning_rate"] == 0.001 and tc.data["max_steps"] == 3 and plan.launcher_args == []
    assert tc.origins["learning_rate"] == "--set learning_rate=0.001"  # named in schema errors like any --set
    # launcher options with their values go to the launcher; keys are checked by axolotl's schema later
    p = split_passthrough(["--num_processes", "2", "--main_process_port=29501", "--seed", "7"], "accelerate")
    assert p.launcher_args == ["--num_processes", "2", "--main_process_port=29501"] and p.overrides == [
        "seed=7"
    ]
    with pytest.raises(UsageError, match="needs a value"):
        split_passthrough(["--learning_rate"], "accelerate")


def test_multi_node_rendezvous_passes_through_to_torchrun(tmp_path):
    """What node 1 of a 2-node run gets (docs/training.md, 'Several GPUs and nodes'): torchrun's static
    rendezvous, so that node 0 holds global rank 0, which writes the adapter."""
    rdzv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29400"]
    tc, plan = training_setup(
        TINY, [f"base_model={tmp_path}"], gpus=1, launcher="torchrun", launcher_args=rdzv, visible=[]
    )
    assert (plan.world, plan.node_rank, plan.launcher_args) == (2, 1, rdzv)
    assert plan.choice.strategy == "ddp" and tc.data["ddp_find_unused_parameters"] is False
    cmd = launcher_command(tmp_path / "resolved.yml", plan.gpus, plan.launcher, plan.launcher_args)
    assert cmd[cmd.index("--launcher") + 1] == "torchrun" and cmd[cmd.index("--") + 1 :] == rdzv
    with pytest.raises(UsageError, match="static one"):
        training_setup(
            TINY,
            [f"base_model={tmp_path}"],
            launcher="torchrun",
            launcher_args=["--nnodes=2", "--rdzv-backend", "c10d"],
        )


def _params(command: click.Command) -> set[str]:
    return {p.name for p in command.params}


def test_run_accepts_every_training_option_of_train():
    from pipeline.cli import load_command

    train, run = load_command("train"), load_command("run")
    training = _params(train) - {"progress", "as_json", "config", "name"}
    assert training <= _params(run), training - _params(run)
    assert isinstance(run, typer.core.TyperCommand) and run.context_settings.get("allow_extra_args")


def test_run_passes_the_training_options_on(project, tiny_base):
    from pipeline.jobs.run import run

    with pytest.raises(UsageError, match="--launcher python runs one process"):
        run(project, TINY, overrides=[f"base_model={tiny_base}"], gpus=2, launcher="python")
    with pytest.raises(UsageError, match="worker nodes"):
        run(
            project,
            TINY,
            overrides=[f"base_model={tiny_base}"],
            launcher="torchrun",
            launcher_args=["--nnodes", "2", "--node_rank", "1"],
        )


def test_schedule_for_two_gpus_trains_on_two():
    from pipeline.cli import load_command
    from pipeline.jobs.schedule import ScheduleSpec

    spec = ScheduleSpec(
        config="/srv/cfg.yml", name="agent-tools", gpus=2, pipeline_bin="/srv/.venv/bin/pipeline"
    )
    cmd = spec.command("systemd")
    assert cmd[cmd.index("--gpus") + 1] == "2"
    ctx = load_command("run").make_context("run", cmd[2:])  # the emitted arguments parse as `pipeline run`'s
    assert ctx.params["gpus"] == 2
    assert "--gpus" not in ScheduleSpec(config="/c.yml", name="a", pipeline_bin="/p").command()
