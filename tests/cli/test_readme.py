"""The README runs: every code block in it is marked with how it is tested, and each runs here or on a GPU machine.

A block is preceded by ``<!-- readme-test: KIND -->``:

* ``pip``: each command runs as written plus ``--dry-run --no-deps --no-build-isolation`` (it must say what it would
  install, without changing the environment the tests run in);
* ``doctor``: each command runs as written and ends with the doctor's verdict (exit 0, or 1 for blocking problems);
* ``python``: the block runs in a fresh interpreter;
* ``make``: each ``make`` target runs as written, with the variables of the ``make test`` that runs this test
  (``MAKEFLAGS``), and must end with a matching comparison;
* ``ci``: each command is one ``.ci/run`` runs (CI itself runs it on a fresh clone);
* ``gpu``: GPU machines only, with DeepEP: the installer with the DeepEP and NCCL trees in
  ``MEGATRON_DEEPEPV2_README_TREES``, the launch from the Megatron-LM tree in ``MEGATRON_LM``; skipped with the reason
  otherwise.

Relative links of the README and of ``docs/`` must name files that exist. What the README names must exist too: its
``MEGATRON_DEEPEPV2_*`` variables are settings' (or read elsewhere), its repository paths and ``python -m`` modules
exist, the Megatron flags of "Not yet run / not supported" are Megatron's, and each message it quotes (``"..."`` in
backticks) is a string of the package.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests import preloaded_python

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
KINDS = ("pip", "doctor", "python", "make", "ci", "gpu")
_BLOCK = re.compile(r"(?:<!-- readme-test: (?P<kind>[a-z]+) -->\n\s*)?```(?P<lang>[a-z]*)\n(?P<body>.*?)```", re.S)
# The arguments of the README's launch when the GPU test runs it: a small GPT-MoE on mock data. SwiGLU: megatron-core
# 0.19's experts fail with GELU and its (default) fused bias path ("Only support fusion of swiglu and quick_gelu with
# per_token_scale in MLP"), whatever the dispatcher.
GPU_GPT_MOE_ARGS = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --transformer-impl local --no-persist-layer-norm "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion --no-bias-swiglu-fusion "
    "--swiglu --disable-bias-linear --num-layers 2 --hidden-size 512 --ffn-hidden-size 1024 --num-attention-heads 8 --seq-length 256 "
    "--max-position-embeddings 256 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 "
    "--micro-batch-size 2 --global-batch-size {batch} --expert-model-parallel-size {gpus} --train-iters 10 "
    "--lr 3e-4 --bf16 --eval-iters 0 --eval-interval 1000 --log-interval 5"
)


class Block(NamedTuple):
    kind: str | None
    lang: str
    body: str
    line: int

    @property
    def commands(self) -> list[str]:
        """Shell commands of the block: continuation lines joined, comments and blank lines dropped."""
        text = self.body.replace("\\\n", " ")
        return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def blocks(text: str) -> list[Block]:
    return [Block(m["kind"], m["lang"], m["body"], text[:m.start()].count("\n") + 1) for m in _BLOCK.finditer(text)]


def _of_kind(kind: str) -> list[Block]:
    return [block for block in blocks(README.read_text()) if block.kind == kind]


def _cpu_env() -> dict:
    """The tests' Python first on PATH (``python`` preloaded, :mod:`tests.preloaded_python`), no GPU visible."""
    bin_dirs = os.pathsep.join([str(Path(preloaded_python.python()).parent), str(Path(sys.executable).parent)])
    return {**os.environ, "PATH": f"{bin_dirs}{os.pathsep}{os.environ.get('PATH', '')}", "CUDA_VISIBLE_DEVICES": ""}


def _run(command: str, timeout: int, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env or _cpu_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_every_code_block_is_marked_and_there_is_one_of_each_cpu_kind() -> None:
    found = blocks(README.read_text())
    unmarked = [block.line for block in found if block.kind not in KINDS]
    assert not unmarked, f"README code blocks at lines {unmarked} lack a <!-- readme-test: KIND --> marker ({KINDS})"
    assert {block.kind for block in found} >= {"pip", "doctor", "python", "make", "ci"}


def test_marker_parsing_finds_unmarked_blocks() -> None:
    text = "<!-- readme-test: python -->\n```python\nx = 1\n```\n\n```bash\necho hi \\\n  there # no\n```\n"
    first, second = blocks(text)
    assert (first.kind, first.lang, first.body) == ("python", "python", "x = 1\n")
    assert second.kind is None and second.line == 6 and second.commands == ["echo hi    there # no"]


def test_pip_commands_would_install_this_package() -> None:
    for block in _of_kind("pip"):
        for command in block.commands:
            done = _run(f"{command} --dry-run --no-deps --no-build-isolation", timeout=300)
            assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
            assert "Would install megatron-deepepv2" in done.stdout, done.stdout[-2000:]


def test_doctor_commands_end_with_a_verdict() -> None:
    for block in _of_kind("doctor"):
        for command in block.commands:
            done = _run(command, timeout=300)
            assert done.returncode in (0, 1), f"{command} exited {done.returncode}: {done.stderr[-2000:]}"
            verdict = done.stdout.strip().splitlines()[-1]
            assert verdict == "No blocking problems." or re.fullmatch(r"\d+ blocking problem\(s\)\.", verdict), verdict


def test_python_blocks_run() -> None:
    for block in _of_kind("python"):
        done = subprocess.run([preloaded_python.python(), "-c", block.body], cwd=ROOT, env=_cpu_env(), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"README line {block.line}: {done.stderr[-3000:]}"


def _make_variable(name: str, default: str) -> str:
    """A variable of the calling ``make`` (``MAKEFLAGS`` carries its command-line assignments), else ``default``."""
    for word in shlex.split(os.environ.get("MAKEFLAGS", "").replace("\\ ", "\0")):
        key, sep, value = word.partition("=")
        if sep and key == name:
            return value.replace("\0", " ")
    return default


def test_make_targets_run_as_written() -> None:
    venv = Path(_make_variable("VENV", ".venv"))
    if not (venv if venv.is_absolute() else ROOT / venv).joinpath(".installed").exists():
        pytest.skip(f"make's environment {venv} is not installed here: run through `make test`, which creates it")
    import torch

    from tests.gpu_jobs import gpu_job_env, gpu_job_lock

    for block in _of_kind("make"):
        for command in block.commands:
            assert command.startswith("make "), command
            # On a GPU machine the demo takes every GPU (a rank each): a GPU job, with the GPU jobs' environment.
            with gpu_job_lock(gpus=torch.cuda.device_count() or 1):
                done = _run(command, timeout=900, env=gpu_job_env())
            assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
            output = done.stdout + done.stderr
            assert "MATCH" in output and "MISMATCH" not in output, output[-3000:]
            if "demo" in command and _deepep_usable() is None:  # a GPU machine with DeepEP trains on ElasticBuffer
                assert "deepep backend" in output, output[-3000:]


def test_ci_commands_are_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for block in _of_kind("ci"):
        for command in block.commands:
            assert command in (line.strip() for line in ci), f"{command!r} is not a command of .ci/run"


def _deepep_usable() -> str | None:
    """Why the GPU blocks cannot run here, or None."""
    import torch

    if not torch.cuda.is_available():
        return "the README's GPU blocks run on a GPU machine; no CUDA GPU here"
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend

    return DeepEPBackend.unavailable_reason()


# What a dry run of the installer prints for each change it would make (and only then).
_INSTALLER_CHANGE = re.compile(r"\bwould (?:run|build|install|write)\b")


def installer_would_change(dry_run_output: str) -> bool:
    """Whether the installer's ``--dry-run`` output plans any change to the machine (a build, an install, a file)."""
    return bool(_INSTALLER_CHANGE.search(dry_run_output))


def test_installer_plan_tells_a_change_from_none() -> None:
    """Each kind of change a dry run of the installer announces is seen; a plan without one (every step found done) is
    not a change, nor is the final line that says a dry run changed nothing."""
    nothing = ("[3/8] nccl: PyTorch's NCCL 2.30.7 (0.1 s)\n[6/8] deep_ep: installed, same build (0.2 s)\n"
               "done in 1.2 s (dry run: nothing changed)\n")
    assert not installer_would_change(nothing)
    for planned in ("    would run: python -m pip install x", "[3/8] nccl: none; would build NCCL 2.30.7 for sm_90 into /p",
                    "[5/8] torch-nccl: would write /x/megatron_deepepv2_nccl.pth", "[2/4] install: would install a.whl",
                    "[6/8] deep_ep: would build DeepEP with g++ against NCCL at /p"):
        assert installer_would_change(nothing + planned), planned


def test_gpu_blocks_run_on_a_gpu_machine() -> None:
    reason = _deepep_usable()
    if reason:
        pytest.skip(reason)
    import torch

    from tests.gpu_jobs import gpu_job_env, gpu_job_lock

    gpus = torch.cuda.device_count()
    trees, megatron_lm = os.environ.get("MEGATRON_DEEPEPV2_README_TREES"), os.environ.get("MEGATRON_LM")
    ran = 0
    for block in _of_kind("gpu"):
        for command in block.commands:
            env = {**gpu_job_env(), "NUM_GPUS": str(gpus), "GPT_MOE_ARGS": GPU_GPT_MOE_ARGS.format(gpus=gpus, batch=2 * gpus)}
            if "install_deepep" in command and trees:
                # It runs alone only when it would change the environment the other GPU jobs import from; a machine
                # that has these trees' builds installed already (verify and doctor only) shares the GPU.
                plan = _run(f"{command} --dry-run", timeout=300, env=env, cwd=Path(trees))
                assert plan.returncode == 0, f"{command} --dry-run: {plan.stdout[-2000:]}{plan.stderr[-2000:]}"
                with gpu_job_lock(gpus=1, alone=installer_would_change(plan.stdout + plan.stderr)):
                    done = _run(command, timeout=1200, env=env, cwd=Path(trees))
            elif "pretrain_gpt.py" in command and megatron_lm:
                env["PYTHONPATH"] = f"{megatron_lm}{os.pathsep}{env.get('PYTHONPATH', '')}"
                with gpu_job_lock(gpus=gpus):
                    done = _run(command, timeout=1200, env=env, cwd=Path(megatron_lm))
                output = done.stdout + done.stderr
                # Ten steps on ElasticBuffer: the deepepv2 layers took the DeepEP backend and training finished.
                assert "_DeepepV2Manager (backend deepep" in output and re.search(r"iteration\s+10/\s+10 \|", output), \
                    output[-4000:]
            else:
                continue
            assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
            ran += 1
    if not ran:
        pytest.skip("set MEGATRON_DEEPEPV2_README_TREES (a folder with DeepEP/ and nccl/) and MEGATRON_LM (a Megatron-LM "
                    "checkout) to run the README's GPU blocks")


def test_gpu_launch_arguments_parse_and_validate_here(tmp_path: Path) -> None:
    """The README's launch with the arguments its GPU test gives it passes Megatron's parsing and validation with the
    plugin on this megatron-core (a torchrun stand-in runs one rank; a pretrain_gpt.py stand-in stops at the config)."""
    from tests.launch_stand_ins import stand_in_launch

    launches = [c for block in _of_kind("gpu") for c in block.commands if "pretrain_gpt.py" in c]
    assert launches, "the README has no pretrain_gpt.py launch"
    tree, env = stand_in_launch(tmp_path, {**_cpu_env(), "NUM_GPUS": "1",
                                           "GPT_MOE_ARGS": GPU_GPT_MOE_ARGS.format(gpus=1, batch=2)})
    for command in launches:
        done = _run(command, timeout=240, env=env, cwd=tree)
        assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
        assert "CONFIG flex deepepv2 8 True False" in done.stdout, done.stdout[-2000:]


_LINK = re.compile(r"\]\((?!https?://|#)(?P<target>[^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_name_files_that_exist(page: str) -> None:
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    missing = [m["target"] for m in _LINK.finditer(path.read_text()) if not (path.parent / m["target"]).exists()]
    assert not missing, f"{page} links to missing files: {missing}"


def _section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _package_strings() -> list[str]:
    """Every string constant of the package's modules (adjacent literals joined, f-strings' literal parts)."""
    found = []
    for path in sorted((ROOT / "megatron_deepepv2").rglob("*.py")):
        found.extend(node.value for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str))
    return found


def test_readme_names_settings_paths_and_modules_that_exist() -> None:
    from megatron_deepepv2.config import OTHER_VARIABLES, setting_variables

    text = README.read_text()
    variables = set(re.findall(r"MEGATRON_DEEPEPV2_[A-Z0-9_]*[A-Z0-9]", text))
    assert not variables - set(setting_variables()) - set(OTHER_VARIABLES), variables
    paths = set(re.findall(r"`((?:tools|tests|docs|examples|megatron_deepepv2)/[^`\s]*)", text))
    assert paths and not [path for path in paths if not (ROOT / path).exists()], paths
    modules = set(re.findall(r"python -m (megatron_deepepv2(?:\.\w+)*)", text))
    assert "megatron_deepepv2.cli.doctor" in modules
    assert not [name for name in modules if importlib.util.find_spec(name) is None], modules


def test_readme_quotes_messages_the_package_has() -> None:
    quoted = re.findall(r'`"([^"`]+)"`', README.read_text())
    assert len(quoted) >= 10, quoted  # the refused combinations and the troubleshooting lines
    strings = _package_strings()
    missing = [message for message in quoted if not any(message in string for string in strings)]
    assert not missing, f"the README quotes messages no module of the package has: {missing}"


def test_not_yet_run_section_names_megatron_flags_that_exist() -> None:
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    section = _section(README.read_text(), "Not yet run / not supported")
    flags = set(re.findall(r"`(--[a-z0-9-]+)", section))
    assert "--moe-pad-expert-input-to-capacity" in flags, flags
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    unknown = sorted(flags - set(parser._option_string_actions))
    assert not unknown, f"the README names flags Megatron does not have: {unknown}"


def test_readme_opens_with_what_ran_and_stays_short() -> None:
    """What a reader sees first: at most 130 lines, the intro saying what the package ran on, then the measured
    headline, whose figures cite a JSON in docs/ that exists and the commit that JSON recorded."""
    import json
    import re

    text = README.read_text()
    assert len(text.splitlines()) <= 130, len(text.splitlines())
    intro = text.split("<!-- headline:start -->")[0]
    assert "H200" in intro and "dd758ca" in intro and "v2.30.7-1" in intro
    headline = text.split("<!-- headline:start -->")[1].split("<!-- headline:end -->")[0]
    (path,) = set(re.findall(r"\]\((docs/training_[a-z0-9_]+\.json)\)", headline))
    recorded = json.loads((ROOT / path).read_text())["provenance"]
    assert recorded["git_commit"] and recorded["git_commit"] in headline
    assert recorded["date"][:10] in headline
