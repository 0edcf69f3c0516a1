"""Configs: every shipped option composes and validates; bad input from the command line is one line on
stderr with exit code 2 and starts nothing; the run config round-trips; --help documents every key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nxdt.planner import plan

from nxdt.config import ConfigError, available_options, compose_config, field_docs, load_run_config, save_run_config
from nxdt.planner import Plan


@pytest.mark.parametrize("group", ["model", "data", "instance"])
def test_every_shipped_option_composes_and_validates(group):
    options = available_options(group)
    assert options
    # a batch every instance's full-node data parallelism divides (1536 = 2^9·3)
    batch = ["data.micro_batch_size=1", "data.global_batch_size=1536"] if group == "instance" else []
    for option in options:
        cfg = compose_config([f"{group}={option}", *batch])
        assert cfg.trainer.devices >= 1
        assert plan(cfg).world_size == cfg.trainer.devices


def test_defaults_follow_nxdt_names_and_interpolate():
    cfg = compose_config(["trainer.max_steps=17"])
    assert cfg.model.optim.sched.max_steps == 17  # ${trainer.max_steps}
    assert cfg.data.source == "text" and cfg.model.vocab_size == 256 and cfg.instance.name == "cpu"


@pytest.mark.parametrize(
    "overrides, zero1",
    [
        ([], True),  # llama_tiny on 2 CPU ranks: DP2
        (["trainer.devices=1"], False),  # one data-parallel rank: nothing to shard
        (["distributed_strategy.tensor_model_parallel_size=2"], False),  # TP2 on 2 ranks: DP1
        (["trainer.devices=4", "distributed_strategy.tensor_model_parallel_size=2"], True),
        (["distributed_strategy.fsdp.enabled=true"], False),  # FSDP shards the optimizer state itself
        (["precision.type=bf16SR"], False),  # shards would round with other random bits than one process
        # experts sharded over their own replicas (none here: DP2 = EP2, each rank's experts whole)
        (["model=mixtral_tiny", "trainer.devices=2", "distributed_strategy.expert_model_parallel_size=2"], True),
        (["distributed_strategy.zero1=false"], False),
        (["trainer.devices=1", "distributed_strategy.zero1=true"], True),  # what the user says stands
    ],
)
def test_zero1_defaults_to_on_wherever_it_trains_as_plain_data_parallelism(overrides, zero1):
    """``distributed_strategy.zero1: null`` resolves when the config is validated (NxDT's default is true) and the run's
    config.yaml keeps the resolved value."""
    assert compose_config(overrides).distributed_strategy.zero1 is zero1


# what Hydra does with each kind of override: a value, a group choice before or after values, a recipe (+group), a
# forced add (++), a new key (+), and overrides Hydra refuses (a key that is not there, + on an existing key). Hydra's
# delete (~key) nxdt refuses itself (below).
HYDRA_CASES = [
    [],
    ["model.hidden_size=64"],
    ["model=gpt_tiny", "model.hidden_size=64"],
    ["model.hidden_size=64", "model=gpt_tiny"],
    ["+recipe=lora", "model.optim.lr=0.5", "data.seq_length=64"],
    ["+recipe=sft", "++seed=3"],
    ["instance=trn1.32xlarge", "instance.devices=4", "launcher=slurm", "launcher.partition=p"],
    ["name=${oc.env:HOME}", "model.optim.betas=[0.5,0.6]"],
    ["trainer.max_stepz=3"],
    ["model=gpt_tiny", "trainer.nope=1"],
    ["+seed=2"],
    [],
]


def test_compose_is_hydras_compose_with_each_group_choice_composed_once():
    """``compose_config`` composes the config groups a command line chooses once per process and sets its other
    overrides on a copy with Hydra's own override code (``nxdt.config._hydra_compose``): the config, or the one-line
    error, is what a fresh ``hydra.compose`` of the same overrides gives, in any order, and a case never sees what an
    earlier one set (the last case, the defaults, comes after every other)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from nxdt.config import CONFIG_MODULE, config_error_from_hydra, to_config

    def hydras(overrides):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        except HydraException as exc:
            return str(config_error_from_hydra(exc))
        finally:
            GlobalHydra.instance().clear()
        OmegaConf.set_struct(cfg, False)
        cfg.name = cfg.name  # resolved while Hydra's node is there (the default is the model's group choice)
        cfg.pop("hydra")
        return to_config(cfg)

    def ours(overrides):
        try:
            return compose_config(overrides, check=False)
        except ConfigError as exc:
            return str(exc)

    for overrides in HYDRA_CASES:
        assert ours(overrides) == hydras(overrides), overrides
    assert isinstance(ours(["trainer.max_stepz=3"]), str) and ours([]).model.hidden_size == 128


def test_the_run_is_named_after_its_model_unless_named():
    """The default run directory is the model config's name (``model=gpt_tiny`` runs went to outputs/llama_tiny/,
    and its summary suggested ``llama_tiny-hf``); a recipe's own name and ``name=`` win."""
    assert compose_config([]).name == "llama_tiny"
    assert compose_config(["model=gpt_tiny"]).name == "gpt_tiny"
    assert compose_config(["model=mixtral_tiny", "trainer.max_steps=3"]).name == "mixtral_tiny"
    assert compose_config(["model=gpt_tiny", "+recipe=sft"]).name == "sft"
    assert compose_config(["model=gpt_tiny", "name=mine"]).name == "mine"


@pytest.mark.parametrize("override", ["~trainer.max_steps", "~exp_manager", "+recipe=sft ~model_alignment_strategy.sft"])
def test_hydras_delete_is_refused_naming_the_key(override):
    """``~key`` either failed in OmegaConf's words (a typed key cannot be deleted) or, for a whole section, silently
    reset every value in it to its default; it is refused, naming the key."""
    *before, delete = override.split()
    with pytest.raises(ConfigError, match=rf"^config error: {delete[1:]}: is a Hydra delete \(~key\)"):
        compose_config([*before, delete])


def test_run_config_round_trip(tmp_path):
    cfg = compose_config(["data=synthetic", "trainer.devices=4", "data.global_batch_size=16", "model.optim.lr=0.01"])
    save_run_config(cfg, tmp_path / "config.yaml")
    assert load_run_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize(
    "text",
    [
        None,  # a config.yaml as nxdt writes it
        "a:\n  lr: 1e-3\n  x: .5\n  y: 1_000\n  z: -2.5E+2\n  when: 2020-01-01\n  flag: yes\n  v: 1.0.0\n  n: ~\n",
        "a: &anchor {b: [1, 2]}\nc: *anchor\nd: '0x1f'\ne: 0x1f\nf: .inf\ng: -.nan\n",
    ],
)
def test_run_configs_read_as_omegaconf_reads_them(tmp_path, text):
    """The run-config reader (libyaml's parser with OmegaConf's rules, read once) gives what OmegaConf's own loader
    gives: floats without a dot (1e-3), YAML 1.1's booleans, no timestamps, aliases copied."""
    from omegaconf import OmegaConf

    from nxdt.config import read_run_config_data

    path = tmp_path / "config.yaml"
    if text is None:
        save_run_config(compose_config(["data=synthetic", "model.optim.lr=1e-3", "model.optim.eps=1e-8"]), path)
    else:
        path.write_text(text)
    got = read_run_config_data(path)
    assert got == OmegaConf.to_container(OmegaConf.create(path.read_text()))
    if text is not None and "lr" in text:
        assert got["a"]["lr"] == 0.001 and got["a"]["when"] == "2020-01-01" and got["a"]["flag"] is True


@pytest.mark.parametrize(
    "text, needle",
    [
        ("a: 1\na: 2\n", "found duplicate key a"),  # OmegaConf refuses it too; PyYAML alone keeps the last
        ("a: !!python/object/apply:os.system ['true']\n", "could not determine a constructor"),
        ("- 1\n", "not a mapping"),
        ("", "holds nothing"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_crafted_run_configs_are_refused_in_one_line(tmp_path, text, needle):
    from nxdt.config import read_run_config_data

    path = tmp_path / "config.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=needle):
        read_run_config_data(path)
    with pytest.raises(ConfigError):
        load_run_config(path)


def test_load_run_config_rejects_unknown_keys(tmp_path):
    (tmp_path / "config.yaml").write_text("trainer:\n  devicez: 2\n")
    with pytest.raises(ConfigError, match="devicez"):
        load_run_config(tmp_path / "config.yaml")


BAD = [
    (["trainer.max_step=3"], "trainer.max_steps"),  # typo: suggests the key
    (["trainer.devices=two"], "trainer.devices"),  # wrong type
    (["model=llama_huge"], "llama_tiny"),  # unknown group option lists the valid ones
    (["instance=trn9"], "instance"),
    (["+bogus=1"], "bogus"),  # unknown top-level key
    (["trainer.devices=3", "data.global_batch_size=8"], "data.global_batch_size"),  # 8 not divisible by mbs 4 × DP 3
    (["trainer.devices=4", "distributed_strategy.tensor_model_parallel_size=3"], "tensor_model_parallel_size"),
    (["trainer.devices=4", "distributed_strategy.tensor_model_parallel_size=4"], "num_kv_heads"),
    (["data.global_batch_size=6"], "data.global_batch_size"),
    (["data.train_dir=/does/not/exist.txt"], "data.train_dir"),
    (["model.architecture=subprocess.Popen"], "model.architecture"),
    (["precision.type=fp8"], "precision.type"),
    (["data.seq_length=4096"], "data.seq_length"),
    (["trainer.num_nodes=0"], "trainer.num_nodes"),
    (["distributed_strategy.fsdp.prefetch=sometimes"], "prefetch"),
    (["distributed_strategy.fsdp.param_persistence_threshold=-1"], "param_persistence_threshold"),
    (["distributed_strategy.fsdp.enabled=true", "distributed_strategy.zero1=true"], "zero1"),  # FSDP shards the optimizer already
    (["notakeyvalue"], "key=value"),
]


# as real `nxdt train` processes (interpreter start-up, `python -m nxdt.cli`, stderr and the exit status as a shell sees
# them): one case per stage that refuses — the command line, Hydra's composition, the typed schema, validation of values
# and layouts, the model class check (which imports torch)
SUBPROCESS = {
    "notakeyvalue",
    "trainer.max_step=3",
    "trainer.devices=two",
    "data.global_batch_size=6",
    "model.architecture=subprocess.Popen",
}


@pytest.mark.parametrize("overrides,needle", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_starts_nothing(tmp_path, overrides, needle, capsys, monkeypatch):
    """The other cases go through ``main`` in this process: the function the ``nxdt`` script calls, minus interpreter
    start-up (as in test_bad_input_matrix.py)."""
    if " ".join(overrides) in SUBPROCESS:
        result = subprocess.run(
            [sys.executable, "-m", "nxdt.cli", "train", *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        code, err = result.returncode, result.stderr
    else:
        from nxdt.cli import main

        monkeypatch.chdir(tmp_path)  # where a run directory would be created
        code, err = main(["train", *overrides]), capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and needle in lines[0], lines
    assert "Traceback" not in err
    assert not (tmp_path / "outputs").exists()


def test_train_help_documents_every_key():
    result = subprocess.run([sys.executable, "-m", "nxdt.cli", "train", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for key, _, doc in field_docs():
        assert key in result.stdout and doc
    assert "llama3_70b" in result.stdout and "+recipe: dpo, grpo, lora, orpo, sft" in result.stdout


def test_plan_command_prints_a_loadable_plan():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nxdt.cli",
            "plan",
            "--json",
            "trainer.devices=8",
            "data.global_batch_size=64",
            "distributed_strategy.tensor_model_parallel_size=2",
            "model=llama3_8b",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    plan = Plan.from_json(result.stdout)
    assert plan.degrees["dp"] == 4 and plan.groups["tp"][0] == [0, 1]


def test_a_key_inside_a_null_section_opens_it_with_its_defaults():
    """``model_alignment_strategy.peft`` is null until a recipe or file sets it: a key inside it on the command line (or
    the section as a mapping) opens it with its schema's defaults, as a YAML file naming the section does — before, the
    compose failed with OmegaConf's "'NoneType' object has no attribute 'get'", naming no key. ``=null`` closes it."""
    from nxdt.config.schema import PEFTConfig

    for override in ("model_alignment_strategy.peft.lora_rank=4", "model_alignment_strategy.peft={lora_rank: 4}"):
        peft = compose_config(["+recipe=dpo", override]).model_alignment_strategy.peft
        assert peft == PEFTConfig(lora_rank=4), override
    assert compose_config(["+recipe=lora", "model_alignment_strategy.peft=null"]).model_alignment_strategy.peft is None
    dpo = compose_config(["model_alignment_strategy.dpo.kl_beta=0.2"], check=False).model_alignment_strategy.dpo
    assert dpo is not None and dpo.kl_beta == 0.2 and dpo.loss_type == "sigmoid"
