"""Path and query parameters shared by the API and the console: each bounded as the column it reaches
(Postgres `int` is 32 bits, text holds no NUL), so a bad value is a 422 naming it, never a database
error."""

from __future__ import annotations

from typing import Annotated

from litestar.params import Parameter, QueryParameter

INT4_MAX = 2**31 - 1  # steps, ranks, attempts and device indexes are Postgres `int` columns
JOB_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
NODE = r"^[A-Za-z0-9_-]{1,64}$"  # a node name is a subject token (`vigil_common.subjects.token`)

Limit = Annotated[int, QueryParameter(ge=1, le=1000, description="items per page")]
Cursor = Annotated[
    str | None, QueryParameter(description="the `next` of the previous page; absent or empty: the first page")
]
JobId = Annotated[str, Parameter(pattern=JOB_ID, description="a job id (`j-...`)")]
JobIdFilter = Annotated[str | None, QueryParameter(pattern=JOB_ID, description="only this job's records")]
JobEvents = Annotated[str | None, QueryParameter(pattern=JOB_ID, description="only this job's events")]
Rank = Annotated[int | None, QueryParameter(ge=0, le=INT4_MAX, description="only this rank's steps")]
Attempt = Annotated[int | None, QueryParameter(ge=1, le=INT4_MAX, description="only this attempt's steps")]
Step = Annotated[int | None, QueryParameter(ge=0, le=INT4_MAX, description="the step; default: the last")]
NodeName = Annotated[str, Parameter(pattern=NODE, description="a node's name")]
DeviceIndex = Annotated[int, Parameter(ge=0, le=INT4_MAX, description="a device's index on its node")]
