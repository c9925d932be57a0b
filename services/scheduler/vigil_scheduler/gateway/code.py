"""Code packages over HTTP: `POST /api/v1/code` takes a pack's bytes (a gzipped tar, `vigil.codepack`)
and keeps it by its SHA-256; `GET /api/v1/jobs/{id}/code` gives back the pack a job runs (`vigil jobs
code JOB`). A pack that breaks a rule is a 422 naming the entry (`codepack.PackRefused`)."""

from __future__ import annotations

from dataclasses import dataclass

from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, RequestBody, Schema
from litestar.status_codes import HTTP_201_CREATED, HTTP_413_REQUEST_ENTITY_TOO_LARGE

from vigil.api_code import CodePackOut
from vigil_common.bus import Bus
from vigil_scheduler import code_packs
from vigil_scheduler.core import Scheduler
from vigil_scheduler.gateway.auth import principal
from vigil_scheduler.gateway.params import JobId
from vigil_scheduler.gateway.schemas import error_responses

SchedulerDep = NamedDependency[Scheduler]
BusDep = NamedDependency[Bus]
PACK_TYPE = "application/gzip"  # what a download is
UPLOAD_TYPE = "application/octet-stream"  # what an upload is sent as (its bytes are a gzipped tar)
MIB = 1024 * 1024
# a pack's bytes may pass its files' (tar headers, a gzip of what does not compress): the body's limit
SLACK = 1.1


@dataclass
class UploadOperation(Operation):
    """The upload reads its body itself (bytes, not JSON), so its schema is declared here."""

    def __post_init__(self) -> None:
        binary = Schema(type=OpenAPIType.STRING, format="binary")  # type: ignore[arg-type]
        self.request_body = RequestBody(required=True, content={UPLOAD_TYPE: OpenAPIMediaType(schema=binary)})


class CodeController(Controller):
    path = "/"
    tags = ["code"]

    @post(
        "/code",
        status_code=HTTP_201_CREATED,
        summary="Upload a code package (a gzipped tar of the job's folder); kept by its SHA-256",
        operation_class=UploadOperation,
        request_max_body_size=None,  # bounded below by VIGIL_CODE_MAX_MB, not VIGIL_MAX_BODY_BYTES
        responses=error_responses(401, 413, 422),
    )
    async def upload(self, request: Request, scheduler: SchedulerDep, bus: BusDep) -> CodePackOut:
        settings = scheduler.settings
        data = await _body(request, int(settings.code_max_mb * MIB * SLACK) + MIB)
        done = await code_packs.upload(scheduler.pool, bus, settings, data, principal(request))
        return CodePackOut(sha256=done.sha256, bytes=done.bytes, entries=done.entries, stored=done.stored)

    @get(
        "/jobs/{job_id:str}/code",
        summary="The code package a job runs (a gzipped tar), as uploaded",
        media_type=PACK_TYPE,
        responses=error_responses(401, 404, 422),
    )
    async def download(
        self, request: Request, scheduler: SchedulerDep, bus: BusDep, job_id: JobId
    ) -> Response[bytes]:
        sha256, data = await code_packs.of_job(scheduler.pool, bus, job_id, principal(request))
        headers = {
            "Content-Disposition": f'attachment; filename="{job_id}-{sha256[:12]}.tar.gz"',
            "X-Vigil-Code-Sha256": sha256,
        }
        return Response(data, media_type=PACK_TYPE, headers=headers)


class PackTooLarge(HTTPException):
    """A 413 that names its own limit (VIGIL_CODE_MAX_MB's, not VIGIL_MAX_BODY_BYTES's)."""

    names_its_limit = True


async def _body(request: Request, limit: int) -> bytes:
    """The request's body, read as it comes; a 413 once it passes `limit` bytes."""
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PackTooLarge(
                status_code=HTTP_413_REQUEST_ENTITY_TOO_LARGE,
                detail=f"the pack is larger than VIGIL_CODE_MAX_MB allows ({limit} bytes)",
            )
        parts.append(chunk)
    return b"".join(parts)
