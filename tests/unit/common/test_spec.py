import json

import pytest

from tests.unit.guardian.helpers import launch
from vigil.errors import SpecError
from vigil.events import decode
from vigil.spec import PRESETS, JobSpec, parse_spec

FULL = """
name: tiny-gpt
priority: 0
resources: {nodes: 1, gpus_per_node: 2}
model: {preset: tiny}
train: {steps: 200, micro_batch: 8, grad_accum: 1, lr: 3.0e-4, precision: auto, zero_stage: auto, grad_clip: 1.0, seed: 0}
data: {path: null, format: text}
checkpoint: {every: 20, keep: 5}
guardian: {nan: rollback, spike: rollback, divergence: rollback, imbalance: alert, hang_timeout_s: 60, max_rollbacks: 3}
faults: [{kind: nan, step: 40, rank: 1}, {kind: spike, step: 80, factor: 20}]
"""


def fields(text: str) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    return {e["field"]: e["message"] for e in info.value.errors}


def test_the_contract_example_parses_as_yaml_and_json():
    spec = parse_spec(FULL)
    assert spec.resources.world_size == 2
    assert [f.kind for f in spec.faults] == ["nan", "spike"]
    again = parse_spec(spec.model_dump_json(), content_type="application/json")
    assert again == spec


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("name: t\ntrain: {lr: -1}", "train.lr"),
        ("name: t\ntrain: {lr: 0.1, color: red}", "train.color"),
        ("name: t\nresources: {nodes: 0}", "resources.nodes"),
        ("name: t\ntrain: {zero_stage: 4}", "train.zero_stage"),
        ("name: t\nfaults: [{kind: nan, step: 5, rank: 3}]", "faults.0.rank"),
        ("name: t\ntrain: {steps: 10}\nfaults: [{kind: crash, step: 10}]", "faults.0.step"),
        ("name: t\nmodel: {d_model: 250}", "model.d_model"),
        ("name: t\nmodel: {n_kv_head: 3}", "model.n_kv_head"),
        ("name: 'rm -rf /'", "name"),
        ("name: t\nshell: 'echo hi'", "shell"),
        ("name: t\ntrain: {comm: {reduce_bucket_size: 10}}", "train.comm.reduce_bucket_size"),
        ("name: t\ntrain: {comm: {allgather_bucket_size: 1.0e+12}}", "train.comm.allgather_bucket_size"),
        ("name: t\ntrain: {comm: {overlap_comm: sometimes}}", "train.comm.overlap_comm"),
        ("name: t\ntrain: {comm: {buckets: 3}}", "train.comm.buckets"),
        ("name: t\ntrain: {steps: 10}\nfaults: [{kind: oom, step: 10}]", "faults.0.step"),
    ],
)
def test_bad_values_name_their_field(text, field):
    assert field in fields(text)


def test_unknown_field_message_says_so():
    assert fields("name: t\ncommand: ls")["command"] == "unknown field"


def test_not_a_mapping_and_not_yaml():
    assert "(spec)" in fields("- a\n- b")
    assert "(spec)" in fields("name: [unclosed")


def test_explicit_dimensions_override_a_preset():
    dims = parse_spec("name: t\nmodel: {preset: tiny, seq_len: 64}").model.resolved()
    assert dims.seq_len == 64 and dims.d_model == PRESETS["tiny"].d_model


def test_explicit_model_without_preset_needs_every_dimension():
    assert "model" in fields("name: t\nmodel: {preset: null, n_layer: 2}")
    spec = parse_spec(
        "name: t\nmodel: {preset: null, n_layer: 2, n_head: 2, d_model: 64, seq_len: 32, vocab_size: 256}"
    )
    assert spec.model.resolved().n_kv_head == 2


def test_specs_are_immutable():
    spec = JobSpec(name="t")
    with pytest.raises(ValueError):
        spec.name = "u"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("name: t\ntrain: {grad_clip: .inf}", "train.grad_clip"),
        ("name: t\nguardian: {spike_zscore: .inf}", "guardian.spike_zscore"),
        ("name: t\nguardian: {spike_zscore: .nan}", "guardian.spike_zscore"),
        ("name: t\nguardian: {divergence_tolerance: 1.0e308}", "guardian.divergence_tolerance"),
        ("name: t\nguardian: {hang_step_multiple: 1.0e308}", "guardian.hang_step_multiple"),
        ("name: t\ntrain: {warmup_steps: 1000000000000000000}", "train.warmup_steps"),
        ("name: t\nguardian: {spike_warmup: 1000000000000000000}", "guardian.spike_warmup"),
        ("name: t\nfaults: [{kind: nan, step: 1000000000000000000}]", "faults.0.step"),
        ('name: t\ntrain: {steps: "10"}', "train.steps"),
        ("name: t\ntrain: {steps: true}", "train.steps"),
        ("name: t\ntrain: {steps: 10.0}", "train.steps"),
        ('name: t\ntrain: {lr: "0.1"}', "train.lr"),
        ('name: t\ntrain: {offload: "yes"}', "train.offload"),
        ("name: 7", "name"),
        ("name: t\ndata: {path: " + "x" * 5000 + "}", "data.path"),
        ("name: t\ntrain: {steps: 1, steps: 2}", "train.steps"),
        ("name: t\nname: u", "name"),
        ("name: t\nresources: {max_processes: 4}", "resources.max_processes"),
        ("name: t\nresources: {memory_mb: 1}", "resources.memory_mb"),
        ("name: t\nresources: {cpus: 0}", "resources.cpus"),
    ],
)
def test_values_no_run_should_have_are_refused_by_field(text, field):
    assert field in fields(text)


def test_json_values_are_not_coerced_and_duplicates_are_refused():
    for body, field in [
        ('{"name": "t", "train": {"steps": "10"}}', "train.steps"),
        ('{"name": "t", "train": {"grad_clip": Infinity}}', "train.grad_clip"),
        ('{"name": "t", "name": "u"}', "(spec)"),
    ]:
        with pytest.raises(SpecError) as info:
            parse_spec(body, content_type="application/json")
        assert field in {e["field"] for e in info.value.errors}, info.value.errors


def test_a_number_in_exponent_form_is_a_number_in_yaml_as_in_json():
    spec = parse_spec("name: t\ntrain: {lr: 3e-4}\nguardian: {spike_zscore: 1e1}")
    assert spec.train.lr == 3e-4 and spec.guardian.spike_zscore == 10.0


def test_a_non_utf8_body_is_a_spec_error():
    assert "not UTF-8" in fields(b"name: \xff\xfe")["(spec)"]  # type: ignore[arg-type]


def test_a_spec_with_an_entrypoint_reads_back_as_stored() -> None:
    """The scheduler stores the spec as JSON and validates it again at each launch; the built-in trainer's
    `model` (a default) must not come back beside the entrypoint (they are exclusive)."""
    spec = JobSpec.model_validate(
        {"name": "own", "entrypoint": {"argv": ["python", "train.py"], "workdir": "proj"}}
    )
    stored = spec.model_dump(mode="json")
    assert "model" not in stored and stored["entrypoint"]["argv"] == ["python", "train.py"]
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
    assert "entrypoint" not in JobSpec(name="builtin").model_dump()  # LaunchJob v1's wire format


def test_a_jobs_limits_serialise_only_when_set():
    plain = parse_spec("name: t")
    assert set(plain.model_dump()["resources"]) == {"nodes", "gpus_per_node"}  # LaunchJob v1 as before
    limited = parse_spec("name: t\nresources: {max_processes: 256, memory_mb: 2048, cpus: 1.5}")
    assert limited.model_dump()["resources"] == {
        "nodes": 1, "gpus_per_node": 1, "max_processes": 256, "memory_mb": 2048, "cpus": 1.5,
    }  # fmt: skip
    assert JobSpec.model_validate_json(limited.model_dump_json()) == limited


CREDENTIALS = [
    "TOKEN", "GITHUB_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SESSION_TOKEN", "hf_token",
    "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "SECRET", "CLIENT_SECRET", "DJANGO_SECRET_KEY",
    "DB_PASSWORD", "PGPASSWORD", "REDIS_PASSWORD2", "MYSQL_PASSWD", "GPG_PASSPHRASE",
    "WANDB_API_KEY", "OPENAI_API_KEY", "COMET_APIKEY", "PRIVATE_KEY", "SSH_PRIVATE_KEY", "SIGNING_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_CREDENTIAL", "GITHUB_AUTH_TOKEN", "SESSION_COOKIE",
]  # fmt: skip
FRAMEWORK_VARIABLES = [
    "NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_COMPILE_DEBUG", "TORCHINDUCTOR_CACHE_DIR",
    "HF_HOME", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_IMPLICIT_TOKEN", "TRANSFORMERS_OFFLINE",
    "TOKENIZERS_PARALLELISM", "MAX_TOKENS", "WANDB_MODE", "WANDB_PROJECT", "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS",
    "AWS_REGION", "AWS_DEFAULT_REGION", "KEY_COLUMN", "PYTHONUNBUFFERED", "TRITON_CACHE_DIR",
]  # fmt: skip


@pytest.mark.parametrize("name", CREDENTIALS)
def test_an_entrypoint_env_that_names_a_credential_is_refused_naming_it(name: str) -> None:
    spec = {"name": "own", "entrypoint": {"argv": ["python", "t.py"], "env": {name: "x"}}}
    with pytest.raises(SpecError) as info:
        parse_spec(json.dumps(spec), content_type="application/json")
    [error] = info.value.errors
    assert error["field"] == f"entrypoint.env.{name}" and "looks like a credential" in error["message"]


def test_common_framework_variables_pass_the_credential_rule() -> None:
    env = dict.fromkeys(FRAMEWORK_VARIABLES, "1")
    spec = parse_spec(json.dumps({"name": "own", "entrypoint": {"argv": ["python", "t.py"], "env": env}}))
    assert spec.entrypoint is not None and spec.entrypoint.env == env


def test_the_adaptive_hang_timeout_keeps_the_old_fields_and_refuses_a_floor_above_the_timeout():
    old = parse_spec("name: t\nguardian: {hang_timeout_s: 1.0, hang_step_multiple: 5}").guardian
    assert (old.hang_timeout_s, old.hang_step_multiple, old.hang_floor) == (1.0, 5.0, 1.0)  # as before
    assert JobSpec(name="t").guardian.hang_floor == 5.0
    # a spec round-trips (a LaunchJob carries it whole): the default floor is no value, never above the timeout
    assert parse_spec({"name": "t", "guardian": old.model_dump()}).guardian == old
    new = parse_spec("name: t\nguardian: {hang_floor_s: 0.5, hang_step_multiple: 10, hang_window: 50}")
    assert (new.guardian.hang_floor_s, new.guardian.hang_window) == (0.5, 50)
    with pytest.raises(SpecError) as info:
        parse_spec("name: t\nguardian: {hang_timeout_s: 10, hang_floor_s: 30}")
    (error,) = info.value.errors
    assert error["field"] == "guardian.hang_floor_s"
    assert (
        "exceeds guardian.hang_timeout_s (10)" in error["message"] and "lower the floor" in error["message"]
    )
    for text, field in [
        ("guardian: {hang_floor_s: 0}", "guardian.hang_floor_s"),
        ("guardian: {hang_step_multiple: 1}", "guardian.hang_step_multiple"),
        ("guardian: {hang_window: 5}", "guardian.hang_window"),
    ]:
        assert field in fields("name: t\n" + text), text


def test_a_launch_whose_spec_has_a_short_hang_timeout_decodes():
    """The floor's default is no value: a spec with a timeout under 5 s, serialised whole in its LaunchJob,
    still decodes (a default of 5 s above it was once refused on the wire)."""
    sent = launch(2, hang_timeout_s=1.0)
    assert decode(sent.to_bytes()) == sent
