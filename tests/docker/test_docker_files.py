"""What the Dockerfiles pin, set and copy, checked against the repository and the pins."""

import fnmatch
import os
import re
import subprocess

import pytest
from dockerfiles import DOCKERFILES, REPO, read
from packaging.version import Version

from installer.pins import load as load_pins
from installer.vllm_tree import locate

# Per image: platform, TORCH_CUDA_ARCH_LIST, FLASHINFER_CUDA_ARCH_LIST, CUTE_DSL_ARCH.
EXPECTED_TARGETS = {
    "spark": ("linux/arm64", "12.1a", "12.1a", "sm_121a"),
    "blackwell": ("linux/amd64", "10.0a 12.0a", "10.0a 12.0a", "sm_100a"),
}
BASE_TAG = re.compile(r"^vllm/vllm-openai:v(?P<version>\d+\.\d+\.\d+)$")
PINNED_FROM = re.compile(
    r"^--platform=(?P<platform>\S+) \$\{BASE_IMAGE\}@\$\{BASE_DIGEST(?::\?\S+)?\}$"
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


def test_base_is_pinned_by_tag_and_digest(dockerfile):
    name, parsed = dockerfile
    froms = parsed.all("FROM")
    assert len(froms) == 1, "one stage, built on the pinned base"
    match = PINNED_FROM.match(froms[0])
    assert match, f"FROM must be '--platform=... ${{BASE_IMAGE}}@${{BASE_DIGEST}}', is {froms[0]!r}"
    assert match["platform"] == EXPECTED_TARGETS[name][0]
    defaults = parsed.arg_defaults()
    assert BASE_TAG.match(defaults["BASE_IMAGE"]), "BASE_IMAGE must name an exact release tag"
    digest = defaults["BASE_DIGEST"]
    # Either a real digest, or none at all so that the build demands one (FROM's :? guard).
    assert digest is None or re.fullmatch(r"sha256:[0-9a-f]{64}", digest), digest
    if digest is None:
        assert ":?" in froms[0], "an unset BASE_DIGEST must fail the build with a message"


def test_base_vllm_version_is_pinned_and_labelled(dockerfile):
    _, parsed = dockerfile
    defaults = parsed.arg_defaults()
    version = BASE_TAG.match(defaults["BASE_IMAGE"])["version"]
    supported = {pins.version for pins in load_pins(REPO).versions}
    assert version in supported, f"the base carries vLLM {version}; pins support {supported}"
    assert defaults["VLLM_VERSION"] == version, "VLLM_VERSION must match the BASE_IMAGE tag"


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
    assert entrypoint == f'["{IMAGE_ROOT}/docker/entrypoint.sh"]'
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
