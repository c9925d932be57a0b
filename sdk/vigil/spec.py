"""The job spec: what a user submits (YAML or JSON), validated strictly.

Unknown fields are rejected, ranges are checked, and every error names its field.
A spec never carries a shell command, and no field of it reaches a shell.

Sections of their own live beside it and are re-exported here (`from vigil.spec import X` names every
one): `spec_resources` (nodes, devices, limits, elastic), `spec_scheduling` (preemptible, time limit),
`spec_guardian`, `spec_faults`; the strict base
model is `spec_base`'s.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from vigil import documents
from vigil.errors import SpecError
from vigil.spec_base import Action, FieldError, StrictModel, not_a_bool
from vigil.spec_faults import (
    FAULT_KINDS,
    CrashFault,
    Fault,
    HangFault,
    NanFault,
    OomFault,
    SdcFault,
    SlowRankFault,
    SpikeFault,
)
from vigil.spec_guardian import (
    CHECKPOINT_READ_BYTES_S,
    DEFAULT_HANG_FLOOR_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    STARTUP_FLOOR_S,
    STARTUP_MULTIPLE,
    GuardianSpec,
)
from vigil.spec_resources import ElasticSpec, Resources, grad_accum_at, shrink_node_counts
from vigil.spec_scheduling import SchedulingSpec, format_duration, parse_duration

__all__ = [
    "CHECKPOINT_READ_BYTES_S",
    "DEFAULT_HANG_FLOOR_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "PRESETS",
    "STARTUP_FLOOR_S",
    "STARTUP_MULTIPLE",
    "Action",
    "CheckpointSpec",
    "CommSpec",
    "CrashFault",
    "DataSpec",
    "ElasticSpec",
    "EntrypointSpec",
    "Fault",
    "FieldError",
    "GuardianSpec",
    "HangFault",
    "JobSpec",
    "MoESpec",
    "ModelDims",
    "ModelSpec",
    "NanFault",
    "OomFault",
    "Resources",
    "SchedulingSpec",
    "SdcFault",
    "SlowRankFault",
    "SpikeFault",
    "StrictModel",
    "TrainSpec",
    "describe_errors",
    "format_duration",
    "grad_accum_at",
    "looks_like_credential",
    "parse_duration",
    "parse_spec",
    "shrink_node_counts",
]

Precision = Literal["auto", "fp32", "bf16", "fp16"]


ZeroStage = Annotated[Literal["auto", 0, 1, 2, 3], BeforeValidator(not_a_bool)]  # `false` is not stage 0
PresetName = Literal["tiny", "small", "1b", "7b"]


class MoESpec(StrictModel):
    experts: int = Field(8, ge=2, le=256)
    top_k: int = Field(2, ge=1, le=8)

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoESpec:
        if self.top_k > self.experts:
            raise FieldError(
                "model.moe.top_k", f"moe.top_k ({self.top_k}) must not exceed moe.experts ({self.experts})"
            )
        return self


class ModelDims(StrictModel):
    """Concrete model dimensions, after a preset and explicit overrides are combined."""

    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    seq_len: int
    vocab_size: int
    moe: MoESpec | None = None
    ffn_hidden: int | None = None  # SwiGLU width; None: Llama's rule, 8/3 d_model rounded up to 256


# The one table of presets. Parameter counts are checked by tests/unit/worker/test_model.py.
PRESETS: dict[str, ModelDims] = {
    # a few million parameters: CPU tests and the demo
    "tiny": ModelDims(n_layer=4, n_head=4, n_kv_head=2, d_model=256, seq_len=128, vocab_size=256),
    # GPT-2 124M class
    "small": ModelDims(n_layer=12, n_head=12, n_kv_head=12, d_model=768, seq_len=1024, vocab_size=50304),
    "1b": ModelDims(n_layer=22, n_head=32, n_kv_head=4, d_model=2048, seq_len=2048, vocab_size=32000),
    "7b": ModelDims(
        n_layer=32, n_head=32, n_kv_head=8, d_model=4096, seq_len=4096, vocab_size=32000, ffn_hidden=14336
    ),
}


class ModelSpec(StrictModel):
    """A preset, or explicit dimensions; explicit fields override the preset's."""

    preset: PresetName | None = "tiny"
    n_layer: int | None = Field(None, ge=1, le=256)
    n_head: int | None = Field(None, ge=1, le=256)
    n_kv_head: int | None = Field(None, ge=1, le=256)
    d_model: int | None = Field(None, ge=8, le=65536)
    seq_len: int | None = Field(None, ge=8, le=1_048_576)
    vocab_size: int | None = Field(None, ge=2, le=1_048_576)
    moe: MoESpec | None = None

    @model_validator(mode="after")
    def _dims_consistent(self) -> ModelSpec:
        self.resolved()  # raises ValueError naming the field
        return self

    def resolved(self) -> ModelDims:
        """The concrete dimensions: preset values overridden by explicit fields."""
        base: dict[str, Any] = PRESETS[self.preset].model_dump() if self.preset else {}
        for name in ("n_layer", "n_head", "n_kv_head", "d_model", "seq_len", "vocab_size", "moe"):
            value = getattr(self, name)
            if value is not None:
                base[name] = value if name != "moe" else value.model_dump()
        missing = [n for n in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size") if n not in base]
        if missing:
            raise FieldError("model", f"model: without a preset, set {', '.join(missing)}")
        base.setdefault("n_kv_head", base["n_head"])
        if base["d_model"] % base["n_head"]:
            raise FieldError(
                "model.d_model",
                f"model.d_model ({base['d_model']}) must be divisible by model.n_head ({base['n_head']})",
            )
        if (base["d_model"] // base["n_head"]) % 2:
            raise FieldError(
                "model.d_model", "model.d_model / model.n_head must be even (RoPE rotates pairs of channels)"
            )
        if base["n_head"] % base["n_kv_head"]:
            raise FieldError(
                "model.n_kv_head",
                f"model.n_head ({base['n_head']}) must be divisible by model.n_kv_head ({base['n_kv_head']})",
            )
        return ModelDims(**base)


BucketElements = Annotated[int, Field(ge=2**16, le=2**31)]


class CommSpec(StrictModel):
    """DeepSpeed's gradient buckets and overlap (ZeRO stages 1-3; without ZeRO, DeepSpeed all-reduces
    in fixed buckets). null (the default): chosen from the model size and the hardware, reason logged."""

    reduce_bucket_size: BucketElements | None = Field(
        None, description="elements per gradient reduce(-scatter) bucket; null: auto"
    )
    allgather_bucket_size: BucketElements | None = Field(
        None, description="elements per parameter all-gather bucket; null: auto"
    )
    overlap_comm: bool | None = Field(
        None, description="overlap gradient reduction with the backward pass; null: auto (on GPUs)"
    )


class TrainSpec(StrictModel):
    steps: int = Field(200, ge=1, le=10_000_000)
    micro_batch: int = Field(8, ge=1, le=65536)
    grad_accum: int = Field(1, ge=1, le=4096)
    lr: float = Field(3.0e-4, gt=0, le=1.0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1.0, description="cosine floor as a fraction of lr")
    warmup_steps: int | None = Field(None, ge=0, le=10_000_000, description="null: min(100, steps // 10)")
    weight_decay: float = Field(0.1, ge=0, le=1.0)
    precision: Precision = "auto"
    zero_stage: ZeroStage = "auto"
    offload: bool = Field(False, description="ZeRO CPU offload of optimizer state (stages 2 and 3)")
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="0 disables clipping")
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the model: true, false, or auto (on for a GPU, off for CPU)"
    )
    seed: int = Field(0, ge=0, le=2**31 - 1)
    comm: CommSpec = CommSpec()

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else min(100, self.steps // 10)


class DataSpec(StrictModel):
    path: str | None = Field(
        None, max_length=4096, description="a text or JSONL file or directory; null: the built-in corpus"
    )
    format: Literal["text", "jsonl"] = "text"
    tokenizer: str | None = Field(
        None, max_length=4096, description="a tokenizer.json file; null: byte-level"
    )

    @field_validator("path", "tokenizer")
    @classmethod
    def _plain_path(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip() or "\x00" in value:
            raise ValueError("must be a non-empty file path")
        return value


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Names a job's `entrypoint.env` may not set: Vigil's and NATS's own, torchrun's (the worker sets them),
# the loader's, and any that look like they hold a credential.
_RESERVED_ENV_PREFIXES = ("VIGIL_", "NATS_", "LD_", "PYTHONSTARTUP")
_TORCHRUN_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"}  # fmt: skip
# A credential's name, matched by whole words (split on "_", trailing digits dropped), so that
# TOKENIZERS_PARALLELISM or MAX_TOKENS pass and HF_TOKEN, DB_PASSWORD2 or AWS_SECRET_ACCESS_KEY do not;
# a word may also end in one of _CREDENTIAL_ENDINGS (PGPASSWORD, GHTOKEN).
_CREDENTIAL_WORDS = {"SECRETS", "CREDENTIAL", "CREDENTIALS", "PRIVATEKEY", "COOKIE"}
_CREDENTIAL_ENDINGS = ("PASSWORD", "PASSWD", "PASSPHRASE", "SECRET", "TOKEN", "APIKEY")
# KEY after one of these words: API_KEY, ACCESS_KEY (and AWS_ACCESS_KEY_ID), PRIVATE_KEY, SSH_KEY, ...
_KEY_QUALIFIERS = {"API", "ACCESS", "SECRET", "PRIVATE", "SIGNING", "ENCRYPTION", "AUTH", "SSH", "LICENSE",
                   "MASTER", "CLIENT", "SESSION", "ACCOUNT"}  # fmt: skip
_NOT_CREDENTIALS = {"HF_HUB_DISABLE_IMPLICIT_TOKEN"}  # a flag that names a credential without holding one


def looks_like_credential(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential (see `_CREDENTIAL_WORDS`)."""
    upper = name.upper()
    if upper in _NOT_CREDENTIALS:
        return False
    words = [w.rstrip("0123456789") for w in upper.split("_")]
    return any(w in _CREDENTIAL_WORDS or w.endswith(_CREDENTIAL_ENDINGS) for w in words) or any(
        w == "KEY" and i > 0 and words[i - 1] in _KEY_QUALIFIERS for i, w in enumerate(words)
    )


_ARGV_BYTES = 64 * 1024
_ENV_BYTES = 64 * 1024


class EntrypointSpec(StrictModel):
    """The user's own training program: started once per rank, as an argument list (never through a
    shell), in `workdir` (under a code root), with torchrun's environment plus Vigil's and `env`."""

    argv: list[str] = Field(min_length=1, max_length=512, description="the program and its arguments")
    workdir: str | None = Field(
        None,
        max_length=4096,
        description="where it runs, under a code root (VIGIL_CODE_ROOTS); null: the root",
    )
    env: dict[str, str] = Field(default_factory=dict, max_length=256, description="extra environment")
    code: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="the SHA-256 of the code package every attempt runs (`vigil submit --code DIR` sets "
        "it; `workdir` is then a folder inside it); null: code already on the nodes (VIGIL_CODE_ROOTS)",
    )

    @model_serializer(mode="wrap")
    def _no_code(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without a code package the entrypoint serialises as before the field existed (older workers
        refuse unknown fields)."""
        data = handler(self)
        if data.get("code", 0) is None:
            del data["code"]
        return data

    @model_validator(mode="after")
    def _workdir_in_pack(self) -> EntrypointSpec:
        if self.code is not None and self.workdir is not None:
            parts = self.workdir.split("/")
            if self.workdir.startswith("/") or ".." in parts:
                raise FieldError(
                    "entrypoint.workdir",
                    "with a code package, entrypoint.workdir is a folder inside it (relative, no '..')",
                )
        return self

    @field_validator("argv")
    @classmethod
    def _argv(cls, argv: list[str]) -> list[str]:
        for i, arg in enumerate(argv):
            if "\x00" in arg or len(arg) > 4096:
                raise FieldError(
                    f"entrypoint.argv.{i}", f"entrypoint.argv[{i}] holds a NUL or exceeds 4096 characters"
                )
        if not argv[0].strip():
            raise FieldError("entrypoint.argv.0", "entrypoint.argv[0] must name a program")
        if sum(len(a.encode()) + 1 for a in argv) > _ARGV_BYTES:
            raise FieldError("entrypoint.argv", f"entrypoint.argv exceeds {_ARGV_BYTES} bytes")
        return argv

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or "\x00" in value):
            raise ValueError("must be a non-empty folder path")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            where = f"entrypoint.env.{name}" if _ENV_NAME.match(name) else "entrypoint.env"
            upper = name.upper()
            if not _ENV_NAME.match(name):
                raise FieldError(where, f"entrypoint.env: {name[:64]!r} is not a variable name (A-Z, 0-9, _)")
            if upper.startswith(_RESERVED_ENV_PREFIXES) or upper in _TORCHRUN_ENV:
                raise FieldError(where, f"entrypoint.env: {name} is set by Vigil, not by a job")
            if looks_like_credential(name):
                raise FieldError(
                    where,
                    f"entrypoint.env: {name} looks like a credential; a job spec is no place for secrets",
                )
            if "\x00" in value or len(value) > 4096:
                raise FieldError(where, f"entrypoint.env.{name} holds a NUL or exceeds 4096 characters")
        if sum(len(k) + len(v) + 2 for k, v in env.items()) > _ENV_BYTES:
            raise FieldError("entrypoint.env", f"entrypoint.env exceeds {_ENV_BYTES} bytes")
        return env


class CheckpointSpec(StrictModel):
    every: int = Field(20, ge=1, le=1_000_000, description="save every N steps")
    keep: int = Field(5, ge=1, le=1000, description="keep the newest K valid checkpoints")
    memory_every: int | Literal["auto"] = Field(
        "auto",
        description="in-memory snapshot every N steps (host memory, with a peer copy on another node; a "
        "relaunch or rollback loads the newest whole one); auto: every step where it costs under 2 % of "
        "the step, else every N steps keeping it under 1 % per step; 0: none",
    )

    @field_validator("memory_every")
    @classmethod
    def _memory_every(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 <= v <= 1_000_000:
            raise ValueError(f"checkpoint.memory_every must be 0 (off), 1..1000000 or 'auto' (got {v})")
        return v


class JobSpec(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    priority: int = Field(0, ge=-1000, le=1000)
    resources: Resources = Resources()
    model: ModelSpec = ModelSpec()
    train: TrainSpec = TrainSpec()
    data: DataSpec = DataSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    guardian: GuardianSpec = GuardianSpec()
    faults: list[Fault] = Field(default_factory=list, max_length=64)
    entrypoint: EntrypointSpec | None = Field(
        None, description="the user's own training program; null: the built-in GPT trainer (`model`)"
    )
    scheduling: SchedulingSpec = SchedulingSpec()

    @model_serializer(mode="wrap")
    def _one_program(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The program the spec runs, and only it: a spec without an entrypoint serialises as it did
        before the field existed (LaunchJob v1's wire format, and older workers, which refuse unknown
        fields, keep reading it); one with an entrypoint leaves out the built-in trainer's `model`, so
        that what is stored reads back (the two are exclusive)."""
        data = handler(self)
        if data.get("scheduling", 0) == {}:
            del data["scheduling"]  # neither field set: the wire format of before the section existed
        if data.get("entrypoint", 0) is None:
            del data["entrypoint"]
        elif "entrypoint" in data:
            data.pop("model", None)
        return data

    @model_validator(mode="after")
    def _program(self) -> JobSpec:
        if self.entrypoint is not None and "model" in self.model_fields_set:
            raise FieldError(
                "entrypoint",
                "entrypoint and model are exclusive: a job runs its own program or the built-in GPT",
            )
        if self.entrypoint is not None and self.faults:
            raise FieldError(
                "faults", "faults are the built-in trainer's; a job with an entrypoint injects its own"
            )
        return self

    @model_validator(mode="after")
    def _faults_fit(self) -> JobSpec:
        world = self.resources.world_size
        for i, fault in enumerate(self.faults):
            if fault.rank >= world:
                raise FieldError(
                    f"faults.{i}.rank",
                    f"faults[{i}].rank ({fault.rank}) must be below the world size "
                    f"({world} = resources.nodes x resources.gpus_per_node)",
                )
            if fault.step >= self.train.steps:
                raise FieldError(
                    f"faults.{i}.step",
                    f"faults[{i}].step ({fault.step}) must be below train.steps ({self.train.steps})",
                )
        return self


def describe_errors(err: ValidationError) -> list[dict[str, str]]:
    """Field-level errors as `{"field": "train.lr", "message": ...}` dicts."""
    out = []
    for e in err.errors(include_url=False):
        cause = (e.get("ctx") or {}).get("error")
        # a fault's kind is the tag pydantic puts in its location (faults.0.nan.step): not a field; the same
        # word elsewhere is one (guardian.spike)
        loc = e["loc"]
        tag = 2 if loc[:1] == ("faults",) and len(loc) > 2 and loc[2] in FAULT_KINDS else None
        prefix = [str(p) for i, p in enumerate(loc) if i != tag]
        loc = cause.field if isinstance(cause, FieldError) else ".".join(prefix)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        out.append({"field": loc or "(spec)", "message": msg})
    return out


def parse_spec(data: bytes | str | dict[str, Any], *, content_type: str | None = None) -> JobSpec:
    """Parse a spec from YAML, JSON or a dict. Raises SpecError naming each bad field.

    Text is read at a bounded cost (`vigil.documents`): nesting, size and duplicate keys are
    refused before anything is built. CPU-bound for large input: async callers run it in a thread."""
    if isinstance(data, dict):
        raw: Any = data
    else:
        try:
            text = data.decode("utf-8") if isinstance(data, bytes) else data
        except UnicodeDecodeError as exc:
            raise SpecError([{"field": "(spec)", "message": f"not UTF-8 text (byte {exc.start})"}]) from exc
        try:
            raw = documents.load(text, json_only=bool(content_type and "json" in content_type))
        except documents.DocumentError as exc:
            raise SpecError([{"field": exc.field, "message": str(exc)}]) from exc
    if not isinstance(raw, dict):
        raise SpecError([{"field": "(spec)", "message": "a job spec must be a mapping of fields"}])
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(describe_errors(exc)) from exc
