"""``python -m megatron_deepepv2.cli.run`` installs the plugin and runs a script unchanged."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import preloaded_python
from tests.launch_stand_ins import stand_in_launch


def _megatron_ships_deepepv2() -> bool:
    code = ("from megatron.core.transformer.moe import token_dispatcher as t; "
            "print(hasattr(t, '_DeepepV2Manager'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    return done.stdout.strip().endswith("True")

SCRIPT = textwrap.dedent(
    """
    import sys
    from megatron.core.transformer.moe import moe_layer
    from megatron.training.arguments import parse_args

    args = parse_args(ignore_unknown_args=True)
    assert getattr(moe_layer.MoEFlexTokenDispatcher, "_deepepv2_plugin", False)
    print("backend", args.moe_flex_dispatcher_backend, "argv", sys.argv[1:3])
    """
)


def test_without_the_plugin_megatron_rejects_deepepv2(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
            "--moe-flex-dispatcher-backend", "deepepv2"]
    done = subprocess.run([preloaded_python.python(), str(script), *args], capture_output=True, text=True, timeout=240)
    rejected = done.returncode != 0 and "invalid choice: 'deepepv2'" in done.stderr
    # Only a megatron-core that ships its own deepepv2 may accept the name; ask (a second interpreter that imports
    # Megatron, seconds) only when the script was not rejected, the rare case.
    if not rejected and _megatron_ships_deepepv2():
        pytest.skip("this megatron-core ships its own deepepv2, so its CLI accepts the name without the plugin")
    assert rejected, f"exit {done.returncode}: {done.stderr[-3000:]}"


def test_usage_errors(capsys: pytest.CaptureFixture) -> None:
    # In this process: a usage error returns before anything is imported (the exit status is main()'s return value,
    # `sys.exit(main())`, which test_example_launch_parses_and_validates runs as a command).
    from megatron_deepepv2.cli.run import main

    assert main(["/no/such/script.py"]) == 2 and "does not exist" in capsys.readouterr().err
    assert main([]) == 2 and "usage:" in capsys.readouterr().err


def test_example_launch_parses_and_validates(tmp_path: Path) -> None:
    """examples/pretrain_gpt_moe_deepepv2.sh through ``python -m megatron_deepepv2.cli.run``: the plugin is installed, the
    script gets its arguments, which pass Megatron's parsing and validation (with the determinism and CUDA-graph
    variants' flags) and give the model SwiGLU without the fused bias-activation path (which the experts' per-token
    scale breaks on megatron-core 0.19 with GELU)."""
    extra = ["--deterministic-mode", "--cuda-graph-impl", "local"]
    # --deterministic-mode: megatron-core < 0.19 asks the launcher for NCCL_ALGO; 0.19 sets it itself.
    tree, env = stand_in_launch(tmp_path, {**os.environ, "NCCL_ALGO": "Ring"})
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["bash", str(root / "examples" / "pretrain_gpt_moe_deepepv2.sh"), str(tree), "1", *extra],
                          capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "ARGV ['--mock-data', '--tokenizer-type']" in done.stdout, done.stdout[-2000:]
    assert "CONFIG flex deepepv2 64 True False True local" in done.stdout, done.stdout[-2000:]
    assert "ROUTER 8 1 softmax False aux_loss None None None None" in done.stdout, done.stdout[-2000:]


def test_example_deepseek_v3_router_model_parses_and_validates(tmp_path: Path) -> None:
    """MODEL=deepseek-v3-router: DeepSeek-V3's router features (a dense first layer, sigmoid scores with an expert
    bias, the sequence aux loss, group-limited top-k with a scaling factor, a shared expert) pass Megatron's parsing
    and validation with the plugin, behind the alltoall dispatcher too."""
    tree, env = stand_in_launch(tmp_path, {**os.environ, "MODEL": "deepseek-v3-router"})
    root = Path(__file__).resolve().parents[2]
    for extra, dispatcher in (([], "flex deepepv2"),
                              (["--moe-token-dispatcher-type", "alltoall", "--moe-flex-dispatcher-backend", "deepep"],
                               "alltoall deepep")):
        done = subprocess.run(["bash", str(root / "examples" / "pretrain_gpt_moe_deepepv2.sh"), str(tree), "1", *extra],
                              capture_output=True, text=True, timeout=240, env=env, cwd=root)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert f"CONFIG {dispatcher} 64 True False False none" in done.stdout, done.stdout[-2000:]
        assert "ROUTER 6 [0, 1, 1, 1, 1, 1] sigmoid True seq_aux_loss 8 4 2.5 512" in done.stdout, done.stdout[-2000:]
    done = subprocess.run(["bash", str(root / "examples" / "pretrain_gpt_moe_deepepv2.sh"), str(tree), "1"],
                          capture_output=True, text=True, timeout=60, env={**env, "MODEL": "mixtral"}, cwd=root)
    assert done.returncode == 2 and "MODEL=mixtral: use gpt-moe, gpt-moe-large, qwen3-moe-router or deepseek-v3-router" in done.stderr


GIN_SCRIPT = textwrap.dedent(
    """
    import os
    import subprocess
    import sys

    code = "import os; print(os.environ.get('EP_DISABLE_GIN'))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    with open(sys.argv[1], "w") as f:
        f.write(repr((os.environ.get("EP_DISABLE_GIN"), child)))
    """
)


@pytest.mark.parametrize("user_value,nics,expected", [
    (None, [], "1"),  # no RDMA NIC: set before the script runs, inherited by what it starts
    (None, ["/sys/class/infiniband/mlx5_0"], None),  # a NIC: left unset
    ("0", [], "0"),  # the user's value stays
])
def test_run_sets_ep_disable_gin_without_an_rdma_nic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture, user_value, nics,
                                                     expected) -> None:
    """The entry point, in this process with a faked NIC probe (``install()`` is a no-op here: the tests above run
    it): the script and a process it starts see the expected ``EP_DISABLE_GIN``; one INFO line says when it was set."""
    import megatron_deepepv2
    from megatron_deepepv2.cli import doctor
    from megatron_deepepv2.cli.run import main

    monkeypatch.setattr(doctor, "find_rdma_devices", lambda: nics)
    monkeypatch.setattr(megatron_deepepv2, "install", lambda: None)
    monkeypatch.setenv("EP_DISABLE_GIN", "placeholder")  # recorded first, so teardown undoes what main sets
    if user_value is None:
        monkeypatch.delenv("EP_DISABLE_GIN")
    else:
        monkeypatch.setenv("EP_DISABLE_GIN", user_value)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    caplog.set_level(logging.INFO, logger="megatron_deepepv2.cli.doctor")
    script, seen = tmp_path / "train.py", tmp_path / "seen"
    script.write_text(GIN_SCRIPT)

    assert main([str(script), str(seen)]) == 0
    assert seen.read_text() == repr((expected, str(expected)))
    lines = [r for r in caplog.records if "EP_DISABLE_GIN=1" in r.getMessage()]
    assert len(lines) == (1 if expected == "1" and user_value is None else 0), lines
    assert all(r.levelno == logging.INFO for r in lines)


def test_a_module_in_the_current_directory_runs_whatever_the_path_starts_with(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``-m MODULE`` finds a module of the current directory as ``python -m`` does, also where the interpreter's path
    does not start with it (the installed ``megatron-deepepv2-run`` command's starts with its ``bin/``)."""
    import megatron_deepepv2
    from megatron_deepepv2.cli import doctor
    from megatron_deepepv2.cli.run import main

    monkeypatch.setattr(doctor, "find_rdma_devices", lambda: ["/sys/class/infiniband/mlx5_0"])
    monkeypatch.setattr(megatron_deepepv2, "install", lambda: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", [path for path in sys.path if path not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "launch_in_cwd.py").write_text("import sys\nopen(sys.argv[1], 'w').write('ran')\n")

    assert main(["-m", "launch_in_cwd", str(tmp_path / "seen")]) == 0
    assert (tmp_path / "seen").read_text() == "ran"
    sys.modules.pop("launch_in_cwd", None)
