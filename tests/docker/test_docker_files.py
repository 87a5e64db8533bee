# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""What the Dockerfiles pin, set and copy, checked against the repository and the pins."""

import fnmatch
import os
import re
import subprocess

import pytest
from packaging.version import Version

from installer.pins import load as load_pins
from installer.vllm_tree import locate
from tests.docker.dockerfiles import DOCKERFILES, REPO, read

# Per image: platform, TORCH_CUDA_ARCH_LIST, FLASHINFER_CUDA_ARCH_LIST, CUTE_DSL_ARCH.
EXPECTED_TARGETS = {
    "spark": ("linux/arm64", "12.1a", "12.1a", "sm_121a"),
    "blackwell": ("linux/amd64", "10.0a 10.3a 12.0a", "10.0a 10.3a 12.0a", "sm_100a"),
}
BASE_REFERENCE = re.compile(
    r"^vllm/vllm-openai:v(?P<version>\d+\.\d+\.\d+)(?P<digest>@sha256:[0-9a-f]{64})?$"
)
CACHE_VOLUME = "/var/cache/dspark"
IMAGE_ROOT = "/opt/dspark"


@pytest.fixture(params=sorted(DOCKERFILES))
def dockerfile(request):
    return request.param, read(DOCKERFILES[request.param])


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_every_copy_source_exists_and_reaches_the_build_context(dockerfile):
    _, parsed = dockerfile
    ignored = dockerignore_patterns()
    sources = [source for sources, _ in parsed.copies() for source in sources]
    assert sources, "the Dockerfile copies nothing"
    for source in sources:
        assert (REPO / source).exists(), f"COPY source {source} does not exist"
        for pattern in ignored:
            assert not fnmatch.fnmatch(source.rstrip("/"), pattern), (
                f"COPY source {source} is excluded from the build context by .dockerignore"
            )


def test_base_is_one_reference_and_its_digest_is_enforced(dockerfile):
    name, parsed = dockerfile
    assert parsed.all("FROM") == ["--platform=${BASE_PLATFORM} ${BASE}"], "one stage on BASE"
    defaults = parsed.arg_defaults()
    assert BASE_REFERENCE.match(defaults["BASE"]), "BASE must name an exact release tag"
    assert defaults["BASE_PLATFORM"] == EXPECTED_TARGETS[name][0]
    assert defaults["ALLOW_UNPINNED_BASE"] == ""
    # The refusal is the first step, before anything is installed or copied.
    first = parsed.instructions.index(next(i for i in parsed.instructions if i.keyword == "RUN"))
    assert not [i for i in parsed.instructions[:first] if i.keyword in ("COPY", "ADD")]
    check = parsed.instructions[first].args
    assert '"${BASE}" in' in check and "*@sha256:" + "?" * 64 + ")" in check
    assert '"${ALLOW_UNPINNED_BASE}" != 1' in check and "exit 1" in check


def test_refusal_of_an_unpinned_base_runs_in_a_shell(dockerfile):
    """The check of the first RUN, run by sh as the build runs it, for three BASE values."""
    _, parsed = dockerfile
    check = next(i.args for i in parsed.instructions if i.keyword == "RUN")
    pinned = "vllm/vllm-openai:v0.33.0@sha256:" + "a" * 64
    for base, allow, refused in [
        (pinned, "", False),
        ("vllm/vllm-openai:v0.33.0", "", True),
        ("vllm/vllm-openai:v0.33.0@sha256:abc", "", True),
        ("dspark-cpu-standin:local", "1", False),
    ]:
        script = check.replace("${BASE}", base).replace("${ALLOW_UNPINNED_BASE}", allow)
        result = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
        assert (result.returncode != 0) == refused, (base, allow, result.stderr)
        if refused:
            assert "has no @sha256: digest" in result.stderr


def test_no_syntax_directive(dockerfile):
    """A `# syntax=` line makes every build fetch the frontend image from Docker Hub, so an
    offline build fails before its first step; the built-in frontend reads these files."""
    _, parsed = dockerfile
    first_lines = parsed.path.read_text().splitlines()[:40]
    assert not [line for line in first_lines if re.match(r"#\s*syntax\s*=", line)]


def test_base_vllm_version_is_pinned_and_labelled(dockerfile):
    _, parsed = dockerfile
    defaults = parsed.arg_defaults()
    version = BASE_REFERENCE.match(defaults["BASE"])["version"]
    supported = {pins.version for pins in load_pins(REPO).versions}
    assert version in supported, f"the base carries vLLM {version}; pins support {supported}"
    assert defaults["VLLM_VERSION"] == version, "VLLM_VERSION must match the BASE tag"


def test_arch_lists_match_the_target_gpus(dockerfile):
    name, parsed = dockerfile
    env, defaults = parsed.env(), parsed.arg_defaults()
    _, torch_arches, flashinfer_arches, cute_arch = EXPECTED_TARGETS[name]
    assert env["TORCH_CUDA_ARCH_LIST"] == torch_arches
    assert env["FLASHINFER_CUDA_ARCH_LIST"] == flashinfer_arches
    cute_default = defaults.get("CUTE_DSL_ARCH") or ""
    assert env["CUTE_DSL_ARCH"].replace("${CUTE_DSL_ARCH}", cute_default) == cute_arch


def test_both_images_share_runtime_settings():
    """Only the target settings may differ: caches, serving defaults and scripts are common."""
    target_keys = {"TORCH_CUDA_ARCH_LIST", "FLASHINFER_CUDA_ARCH_LIST", "CUTE_DSL_ARCH"}
    spark, blackwell = (read(DOCKERFILES[name]) for name in ("spark", "blackwell"))
    common = {k: v for k, v in spark.env().items() if k not in target_keys}
    assert common == {k: v for k, v in blackwell.env().items() if k not in target_keys}
    for keyword in ("COPY", "RUN", "VOLUME", "HEALTHCHECK", "ENTRYPOINT", "WORKDIR", "EXPOSE"):
        assert spark.all(keyword) == blackwell.all(keyword), keyword


def shared_steps(parsed) -> list:
    """Everything up to the first target-specific setting, less BASE_PLATFORM's default."""
    steps = []
    for instruction in parsed.instructions:
        if instruction.keyword == "ENV" and "TORCH_CUDA_ARCH_LIST" in instruction.args:
            break
        if instruction.args.startswith("CUTE_DSL_ARCH"):
            break
        if not instruction.args.startswith("BASE_PLATFORM="):
            steps.append(instruction)
    return steps


def test_both_images_share_the_install_steps():
    """Identical steps up to the target settings, so both builds share one cached install and
    the CPU stand-in test of those steps covers both images."""
    spark, blackwell = (shared_steps(read(DOCKERFILES[name])) for name in ("spark", "blackwell"))
    assert spark == blackwell
    keywords = [i.keyword for i in spark]
    assert keywords.count("RUN") == 3 and keywords[-1] == "COPY", keywords


def test_install_layer_depends_only_on_what_the_install_reads(dockerfile):
    """Profiles, the entrypoint, the health check and the revision label come after the install
    step, so editing them (or committing) does not re-run it."""
    _, parsed = dockerfile
    steps = list(parsed.instructions)
    install = next(i for i, s in enumerate(steps) if "install-and-verify.sh python3" in s.args)
    sources = [
        source
        for step in steps[:install]
        if step.keyword == "COPY"
        for source in step.args.split()[:-1]
    ]
    assert "recipe/pins.yaml" in sources
    for later in ("recipe/", "docker/entrypoint.sh", "docker/healthcheck.py"):
        assert later not in sources, later
    assert not [s for s in sources if "profiles" in s]
    args_before = [s.args.split("=")[0] for s in steps[:install] if s.keyword == "ARG"]
    assert "DSPARK_REVISION" not in args_before and "DSPARK_SOURCE" not in args_before


def test_jit_caches_live_on_the_volume(dockerfile):
    _, parsed = dockerfile
    assert parsed.all("VOLUME") == [f'["{CACHE_VOLUME}"]']
    cache_keys = [k for k in parsed.env() if k.endswith(("_CACHE_DIR", "_CACHE_PATH", "_ROOT"))]
    cache_keys.append("FLASHINFER_WORKSPACE_BASE")
    assert len(cache_keys) >= 8
    for key in cache_keys:
        assert parsed.env()[key].startswith(CACHE_VOLUME + "/"), key


def test_labels_record_source_revision_vllm_and_pin_digest(dockerfile):
    _, parsed = dockerfile
    labels = " ".join(parsed.all("LABEL"))
    for key, arg in [
        ("org.opencontainers.image.base.name", "BASE"),
        ("org.opencontainers.image.source", "DSPARK_SOURCE"),
        ("org.opencontainers.image.revision", "DSPARK_REVISION"),
        ("io.github.dspark-vllm.vllm.version", "VLLM_VERSION"),
        ("io.github.dspark-vllm.pin.digest", "PIN_DIGEST"),
    ]:
        assert re.search(rf'{re.escape(key)}="\$\{{{arg}[:?}}]', labels), key


def test_build_runs_the_ci_tested_script_with_the_label_values(dockerfile):
    _, parsed = dockerfile
    (run,) = [r for r in parsed.all("RUN") if "install-and-verify.sh" in r]
    assert 'EXPECT_VLLM_VERSION="${VLLM_VERSION}"' in run
    assert 'EXPECT_PIN_DIGEST="${PIN_DIGEST}"' in run
    assert "docker/install-and-verify.sh python3" in run


def test_entrypoint_and_healthcheck_are_the_copied_scripts(dockerfile):
    _, parsed = dockerfile
    assert parsed.all("WORKDIR") == [IMAGE_ROOT]
    copied = {
        f"{IMAGE_ROOT}/{destination}{source.rsplit('/', 1)[-1]}"
        for sources, destination in parsed.copies()
        if destination.endswith("/") and destination != "./"
        for source in sources
    }
    (entrypoint,) = parsed.all("ENTRYPOINT")
    # tini is PID 1: it forwards docker stop's SIGTERM to vLLM and reaps exited workers.
    assert entrypoint == f'["/usr/bin/tini", "--", "{IMAGE_ROOT}/docker/entrypoint.sh"]'
    assert f"{IMAGE_ROOT}/docker/entrypoint.sh" in copied
    (healthcheck,) = parsed.all("HEALTHCHECK")
    assert f'CMD ["python3", "{IMAGE_ROOT}/docker/healthcheck.py"]' in healthcheck
    assert f"{IMAGE_ROOT}/docker/healthcheck.py" in copied


def known_vllm_variables(version: str) -> set[str]:
    """VLLM_* names defined by vLLM `version`: the test environment's tree, or the 0.33.0 sources
    the setup script caches under .cache/."""
    for root in (None, REPO / ".cache" / f"vllm-{version}"):
        if root is not None and not (root / "vllm" / "envs.py").is_file():
            continue
        tree = locate(root)
        if Version(tree.version).public == version:
            text = (tree.package_dir / "envs.py").read_text()
            return set(re.findall(r'^\s+"(VLLM_\w+)":', text, re.MULTILINE))
    message = f"no vLLM {version} sources here; the setup script caches them in .cache/"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def test_vllm_variables_are_known_to_the_base_vllm(dockerfile):
    """vLLM warns about, and ignores, VLLM_* variables it does not define (ops lesson 7 #1)."""
    _, parsed = dockerfile
    version = parsed.arg_defaults()["VLLM_VERSION"]
    known = known_vllm_variables(version)
    assert "VLLM_CACHE_ROOT" in known, "the envs.py reader found nothing"
    unknown = [k for k in parsed.env() if k.startswith("VLLM_") and k not in known]
    assert not unknown, f"vLLM {version} does not define {unknown}"


def test_shipped_scripts_are_executable_in_git():
    listing = subprocess.run(
        ["git", "ls-files", "-s", "docker/entrypoint.sh", "docker/install-and-verify.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(listing) == 2
    assert all(line.startswith("100755 ") for line in listing), listing
