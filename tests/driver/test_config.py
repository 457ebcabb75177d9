"""Config loading: the shipped configs parse; bad keys and values raise errors naming them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rl_driver.config import ConfigError, config_from_dict, load_config, trainer_autocast

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["tiny.yaml", "demo.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(str(CONFIGS / name))
    assert cfg.engine.rhyme and cfg.loop.epochs >= 1
    args = cfg.engine.server_args("/models/x")
    assert args["speculative_algorithm"] == "RHYME" and args["model_path"] == "/models/x"


@pytest.mark.parametrize("raw, message", [
    ({"rollout": {"group_sise": 4}}, "rollout.group_sise"),
    ({"rollout": {"group_size": 0}}, "'rollout.group_size'.*0"),
    ({"rollout": {"balance": "random"}}, "'rollout.balance'.*random"),
    ({"engine": {"rhyme": "yes"}}, "'engine.rhyme'.*yes"),
    ({"engine": {"dtype": "int8"}}, "'engine.dtype'.*int8"),
    ({"engine": {"skip_tokenizer_init": "no"}}, "'engine.skip_tokenizer_init'.*no"),
    ({"train": {"share_prompt_forward": 1}}, "'train.share_prompt_forward'.*1"),
    ({"sync": {"method": "carrier-pigeon"}}, "'sync.method'.*carrier-pigeon"),
    ({"train": {"lr": "fast"}}, "'train.lr'.*fast"),
    ({"train": {"lr": -1.0}}, "'train.lr'.*-1.0"),
    ({"task": {"reward_fn": "nodots"}}, "'task.reward_fn'.*nodots"),
    ({"loop": {"epochs": 0}}, "'loop.epochs'.*0"),
    ({"lopp": {}}, "'lopp'"),
    ({"rollout": [1, 2]}, "'rollout' must be a mapping"),
    ({"name": "a/b"}, "'name'.*a/b"),
])
def test_bad_values_name_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw)


def test_overrides_and_file_errors(tmp_path):
    cfg = config_from_dict({}, {"engine.num_engines": 3, "name": "x"})
    assert cfg.engine.num_engines == 3 and cfg.name == "x"
    assert cfg.train.lr == 5e-6 and isinstance(config_from_dict({"train": {"lr": 1}}).train.lr, float)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {group_size: 4\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    typo = tmp_path / "typo.yaml"
    typo.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"typo.yaml.*train.learning_rate"):
        load_config(str(typo))


def test_reward_fn_path_is_checked():
    from rl_driver.rewards import load_reward_fn, target_token_reward

    assert load_reward_fn("rl_driver.rewards.target_token_reward") is target_token_reward
    with pytest.raises(ValueError, match="rl_driver.rewards.nope"):
        load_reward_fn("rl_driver.rewards.nope")


def test_cli_reports_bad_config(tmp_path, capsys):
    from rl_driver.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout:\n  temperature: -1\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "rollout.temperature" in capsys.readouterr().err


def test_unknown_keys_fail_with_the_allowed_names():
    with pytest.raises(ConfigError, match=r"unknown config key rollout.group_sise \(allowed in "
                       r"rollout: balance, default_predicted_length, group_size, "):
        config_from_dict({"rollout": {"group_sise": 4}})
    with pytest.raises(ConfigError, match=r"'lopp' \(allowed: name, model, seed, engine, "):
        config_from_dict({"lopp": {}})


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["config", "--help"],
                                  ["report", "--help"], ["warm-start", "--help"]])
def test_cli_help_is_plain_text_with_an_example(argv, capsys):
    from rl_driver.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and "example" in text and "rhyme-rl " in text
    if argv[0] in ("train", "config", "warm-start"):  # they name the config reference
        assert "config reference:" in text and "configs/demo.yaml" in text
        assert "rl_driver/config.py" in text and "rhyme-rl config" in text


def test_cli_config_prints_every_key_with_overrides(capsys):
    import yaml

    from rl_driver.cli import main
    from rl_driver.config import SECTIONS

    assert main(["config", "--config", str(CONFIGS / "demo.yaml"), "--set", "loop.epochs=2"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["name"] == "demo" and shown["loop"]["epochs"] == 2
    for section, cls in SECTIONS.items():
        assert list(shown[section]) == [f.name for f in dataclasses.fields(cls)]
    assert main(["config", "--set", "engine.nope=1"]) == 2
    assert "allowed in engine:" in capsys.readouterr().err


def _pick(fast_bf16: bool):
    return lambda requested: requested if requested != "auto" else (
        "bfloat16" if fast_bf16 else "float32")


def test_trainer_autocast_follows_the_engines_dtype():
    """The rule a Trainer built outside a RunConfig (bench_rollout) applies to ``auto`` too."""
    for fast in (True, False):
        assert trainer_autocast("float32", _pick(fast), _pick(fast)) is False
        assert trainer_autocast("auto", _pick(fast), _pick(fast)) is fast
        assert trainer_autocast("bfloat16", _pick(fast), _pick(fast)) is fast


def test_trainer_autocast_is_decided_by_the_trainers_own_probe():
    """Engines in bf16 (their decode probe, or the user) train in bf16 only where the trainer's
    GEMM probe says large bf16 products are fast; engines in fp32 never autocast."""
    assert trainer_autocast("bfloat16", _pick(True), _pick(False)) is False
    assert trainer_autocast("auto", _pick(True), _pick(False)) is False
    assert trainer_autocast("auto", _pick(False), _pick(True)) is False
    assert trainer_autocast("bfloat16", _pick(False), _pick(True)) is True


def test_auto_dtype_autocast_and_threads_resolve_by_machine():
    cfg = load_config(str(CONFIGS / "demo.yaml"))
    assert cfg.engine.dtype == "auto" and cfg.train.autocast_bf16 == "auto"
    slow = cfg.resolved(engine_dtype=_pick(False), train_dtype=_pick(False), cores=2)
    assert slow.engine.dtype == "float32" and slow.train.autocast_bf16 is False
    assert slow.engine.cpu_threads == 1 and slow.train.num_threads == 2
    assert slow.engine.kernel_threads == 1  # the demo's 2 engines share the 2 cores
    assert slow.engine.server_args("/m")["kernel_threads"] == 1
    assert slow.engine.server_args("/m")["dtype"] == "float32"
    fast = cfg.resolved(engine_dtype=_pick(True), train_dtype=_pick(True), cores=16)
    assert fast.engine.dtype == "bfloat16" and fast.train.autocast_bf16 is True
    assert fast.engine.cpu_threads == 7 and fast.train.num_threads == 16
    assert fast.engine.kernel_threads == 8
    again = fast.resolved(engine_dtype=_pick(False), train_dtype=_pick(False), cores=2)
    assert again == fast  # concrete values stay


def test_explicit_dtype_autocast_and_threads_win():
    cfg = config_from_dict({"engine": {"dtype": "float32", "cpu_threads": 3},
                            "train": {"autocast_bf16": False, "num_threads": 1}})
    out = cfg.resolved(engine_dtype=_pick(True), train_dtype=_pick(True), cores=16)
    assert out.engine.dtype == "float32" and out.train.autocast_bf16 is False
    assert out.engine.cpu_threads == 3 and out.train.num_threads == 1
    assert out.engine.server_args("/m")["cpu_threads"] == 3
    # autocast auto follows the engines: an fp32 engine on a fast-bf16 machine trains in fp32,
    # so rollout and trainer logprobs agree; a bf16 engine on a slow-bf16 machine too
    fp32 = config_from_dict({"engine": {"dtype": "float32"}}).resolved(
        engine_dtype=_pick(True), train_dtype=_pick(True))
    assert fp32.train.autocast_bf16 is False
    bf16 = config_from_dict({"engine": {"dtype": "bfloat16"}})
    for fast in (True, False):
        out = bf16.resolved(engine_dtype=_pick(fast), train_dtype=_pick(fast))
        assert out.train.autocast_bf16 is fast
    with pytest.raises(ConfigError, match="'train.autocast_bf16'.*yes"):
        config_from_dict({"train": {"autocast_bf16": "yes"}})
    with pytest.raises(ConfigError, match="'engine.cpu_threads'.*-1"):
        config_from_dict({"engine": {"cpu_threads": -1}})
    with pytest.raises(ConfigError, match="'engine.kernel_threads'.*-2"):
        config_from_dict({"engine": {"kernel_threads": -2}})


def test_cluster_keys_are_checked():
    cfg = load_config(str(CONFIGS / "cluster.yaml"))
    assert cfg.cluster.strategy == "SPREAD" and cfg.engine.num_gpus == 1
    pinned = config_from_dict({"cluster": {"engine_resources": [{"node_a": 1}, {"node_b": 0.5}]},
                               "engine": {"num_engines": 2}})
    assert pinned.cluster.engine_resources_of(1) == {"node_b": 0.5}
    assert config_from_dict({}).sync.master_address == "auto"  # the trainer node's IP
    for raw, message in [
            ({"cluster": {"strategy": "SCATTER"}}, "'cluster.strategy'.*SCATTER"),
            ({"cluster": {"engine_resources": {"node_a": -1}}}, "'cluster.engine_resources'"),
            ({"cluster": {"trainer_resources": {"node_a": "x"}}}, "'cluster.trainer_resources'"),
            ({"cluster": {"engine_resources": [{"a": 1}]}, "engine": {"num_engines": 2}},
             "one mapping per engine"),
            ({"engine": {"num_gpus": -1}}, "'engine.num_gpus'"),
            ({"train": {"num_cpus": "four"}}, "'train.num_cpus'")]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict(raw)


def test_placement_bundles_and_the_no_reservation_default():
    from rl_driver.cli import build_parser, overrides_from
    from rl_driver.placement import Placement, actor_options, bundle

    assert bundle(4, 1, {"node_a": 1}) == {"CPU": 4.0, "GPU": 1.0, "node_a": 1.0}
    assert bundle(0, 0, {}) == {}
    assert actor_options({"CPU": 2.0, "node_b": 0.5}) == {
        "num_cpus": 2.0, "num_gpus": 0.0, "resources": {"node_b": 0.5}}
    # nothing reserved: no placement group, the actors ask Ray for no CPU (as on a laptop)
    free = Placement(config_from_dict({}))
    assert free.group is None
    assert free.engine_options(0) == free.trainer_options() == {"num_cpus": 0}
    args = build_parser().parse_args(["train", "--config", "x.yaml", "--address", "auto"])
    assert overrides_from(args)["cluster.address"] == "auto"
