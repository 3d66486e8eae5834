"""The object-store tier: one S3 object per chunk at `<prefix>/<fingerprint digest>/<hh>/<key hex>.chunk`.

S3 through aiobotocore, on the tier event loop. Objects are written whole: one PUT below
`multipart_threshold` (a chunk of a small model is well under 1 MiB), a multipart upload above
it (aborted on failure), so a reader never sees a partial object.

Several replicas may share a bucket. At start the index is rebuilt by listing the fingerprint's
prefix (headers are checked when a chunk is read: a corrupt or foreign object is a miss and is
deleted). A key the index lacks may have been written by another replica since: the lookup
answers RETRY and a HEAD request runs on the tier loop; its answer is remembered (found: indexed;
absent: MISS for `absent_ttl_s`).

An endpoint that is down, times out or answers 5xx/403 is an outage: lookups MISS and writes are
skipped until a probe (HEAD bucket, exponential backoff) succeeds again. That holds at start too:
a store that cannot be reached does not keep the server from serving (requests recompute), and the
bucket is listed once it answers. A missing bucket or refused credentials fail the start instead:
those are configuration errors that no retry mends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from kvtier.base import MEDIUM_OBJ, Locality, LookupResult, OffloadKey
from kvtier.chunk_format import ModelFingerprint, chunk_relpath, key_from_hex
from kvtier.secondary_tier import MISSING, CheckFactory, Missing, Outage, ReadTarget, SecondaryTier, TierStartupError

log = logging.getLogger(__name__)

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_MAX_ABSENT_KEYS = 65_536
MULTIPART_THRESHOLD = 16 << 20
MULTIPART_PART_SIZE = 8 << 20  # S3's minimum part is 5 MiB (all but the last)


class ObjTier(SecondaryTier):
    medium = MEDIUM_OBJ
    type_name = "obj"

    def __init__(
        self,
        index: int,
        endpoint: str,
        bucket: str,
        capacity_bytes: int,
        fingerprint: ModelFingerprint,
        prefix: str = "",
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str | None = None,
        locality: Locality = Locality.REMOTE,
        demote_on: str = "evict",
        *,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        absent_ttl_s: float = 5.0,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        multipart_part_size: int = MULTIPART_PART_SIZE,
        **kwargs,
    ) -> None:
        super().__init__(index, capacity_bytes, fingerprint, locality, demote_on, **kwargs)
        self.endpoint = endpoint
        self.bucket = bucket
        self.key_prefix = "/".join(part for part in (prefix.strip("/"), fingerprint.digest) if part) + "/"
        self._credentials = (access_key, secret_key)
        self._region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self._client_config = AioConfig(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"max_attempts": 2, "mode": "standard"},
            s3={"addressing_style": "path"},
        )
        self.absent_ttl_s = absent_ttl_s
        self.multipart_threshold = multipart_threshold
        self.multipart_part_size = multipart_part_size
        self._client = None
        self._exit_stack = contextlib.AsyncExitStack()
        self._absent: OrderedDict[OffloadKey, float] = OrderedDict()  # key -> expiry (monotonic)
        self._checking: set[OffloadKey] = set()
        self._to_check: list[OffloadKey] = []
        self._unlisted = False  # unreachable at start: the bucket is listed when a probe succeeds

    def object_key(self, key: OffloadKey) -> str:
        return self.key_prefix + chunk_relpath(key)

    # ---- existence checks (lookups of keys another replica may have written) ------------------

    def _lookup_unindexed(self, key: OffloadKey) -> LookupResult:
        expiry = self._absent.get(key)
        if expiry is not None:
            if expiry > time.monotonic():
                return LookupResult.MISS
            del self._absent[key]
        if key not in self._checking:
            self._checking.add(key)
            self._to_check.append(key)
        return LookupResult.RETRY

    @property
    def has_checks_in_flight(self) -> bool:
        with self._lock:
            return bool(self._checking)

    def is_checking(self, key: OffloadKey) -> bool:
        with self._lock:
            return key in self._checking

    def take_checks(self) -> list[CheckFactory]:
        with self._lock:
            keys, self._to_check = self._to_check, []
        return [lambda: self._check(keys)] if keys else []

    async def _check(self, keys: list[OffloadKey]) -> None:
        try:
            await asyncio.gather(*(self._check_one(key) for key in keys))
        finally:
            with self._lock:
                self._checking.difference_update(keys)

    async def _check_one(self, key: OffloadKey) -> None:
        """HEAD the object: found -> indexed (a HIT from now on); absent or failed -> MISS for a while."""
        size = None
        try:
            assert self._read_slots is not None, "open() first"
            async with self._read_slots:
                response = await asyncio.wait_for(
                    self._client.head_object(Bucket=self.bucket, Key=self.object_key(key)), self.op_timeout_s
                )
            size = int(response["ContentLength"])
        except ClientError as error:
            if _error_code(error) not in _NOT_FOUND:
                self._fail("head", key, error)
        except Exception as error:  # noqa: BLE001 - a failed check is a miss, never a crash
            self._fail("head", key, error)
        if size is None:
            with self._lock:
                self._absent[key] = time.monotonic() + self.absent_ttl_s
                self._absent.move_to_end(key)
                while len(self._absent) > _MAX_ABSENT_KEYS:
                    self._absent.popitem(last=False)
            return
        for victim in self._commit(key, size, None):
            await self._delete_quietly(victim)

    # ---- storage primitives ------------------------------------------------------------------

    async def _open_storage(self) -> list[tuple[OffloadKey, int, float]]:
        where = f"secondary tier {self.name}: bucket {self.bucket!r} at {self.endpoint}"
        access_key, secret_key = self._credentials
        self._client = await self._exit_stack.enter_async_context(
            get_session().create_client(
                "s3",
                endpoint_url=self.endpoint,
                region_name=self._region,
                aws_access_key_id=access_key,
                aws_secret_access_key=secret_key,
                config=self._client_config,
            )
        )
        try:
            await self._client.head_bucket(Bucket=self.bucket)
        except NoCredentialsError:
            await self._close_storage()
            raise TierStartupError(
                f"{where}: no credentials (set access_key/secret_key or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
            ) from None
        except ClientError as error:
            await self._close_storage()
            code = _error_code(error)
            hint = {"404": "no such bucket", "NoSuchBucket": "no such bucket", "403": "access denied (credentials?)"}
            raise TierStartupError(f"{where}: {hint.get(code, f'error {code}')}") from None
        except (BotoCoreError, OSError) as error:
            log.warning("%s is unreachable (%s); serving without it until it answers", where, error)
            self._unlisted = True
            return []
        return await self._list()

    async def open(self) -> None:
        await super().open()
        if self._unlisted:
            self._start_outage("all")

    async def _list(self) -> list[tuple[OffloadKey, int, float]]:
        """This fingerprint's chunks in the bucket: (key, bytes, mtime)."""
        entries: list[tuple[OffloadKey, int, float]] = []
        paginator = self._client.get_paginator("list_objects_v2")
        async for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key_prefix):
            for obj in page.get("Contents", ()):
                name = obj["Key"][len(self.key_prefix) :]
                key = _key_of(name)
                if key is None:
                    continue  # NOTE: not ours to delete in a shared bucket
                entries.append((key, int(obj["Size"]), obj["LastModified"].timestamp()))
        return entries

    async def _get(self, key: OffloadKey, target: ReadTarget) -> tuple[bool, int] | Missing:
        try:
            response = await self._client.get_object(Bucket=self.bucket, Key=self.object_key(key))
        except ClientError as error:
            if _error_code(error) in _NOT_FOUND:
                return MISSING
            raise
        async with response["Body"] as body:
            data = await body.read()  # the whole body at once, not in small reads
        # NOTE: checksum and copy in one thread hop.
        return await asyncio.to_thread(self._land, memoryview(data), key, target)

    async def _put(self, key: OffloadKey, data: bytes) -> None:
        name = self.object_key(key)
        if len(data) <= self.multipart_threshold:
            await self._client.put_object(Bucket=self.bucket, Key=name, Body=data)
            return
        upload = await self._client.create_multipart_upload(Bucket=self.bucket, Key=name)
        upload_id = upload["UploadId"]
        try:
            parts = []
            view = memoryview(data)
            for number, start in enumerate(range(0, len(data), self.multipart_part_size), start=1):
                part = await self._client.upload_part(
                    Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number,
                    Body=bytes(view[start : start + self.multipart_part_size]),
                )
                parts.append({"ETag": part["ETag"], "PartNumber": number})
            await self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
            raise

    async def _delete(self, key: OffloadKey) -> None:
        await self._client.delete_object(Bucket=self.bucket, Key=self.object_key(key))

    async def _probe(self) -> None:
        await self._client.head_bucket(Bucket=self.bucket)
        if self._unlisted:  # down since start: index what the bucket holds, oldest first
            for key, size, _ in sorted(await self._list(), key=lambda entry: entry[2]):
                for victim in self._commit(key, size, None):
                    await self._delete_quietly(victim)
            self._unlisted = False

    def _outage_of(self, op: str, error: BaseException) -> Outage | None:
        if isinstance(error, ClientError):
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return "all" if status >= 500 or status == 403 else None
        if isinstance(error, BotoCoreError | OSError | TimeoutError):
            return "all"  # connection refused or reset, timeouts
        return None

    async def _close_storage(self) -> None:
        self._client = None
        await self._exit_stack.aclose()


def _error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def _key_of(name: str) -> OffloadKey | None:
    """The key of `<hh>/<key hex>.chunk`, or None."""
    hh, _, file_name = name.partition("/")
    if not file_name.endswith(".chunk"):
        return None
    key = key_from_hex(file_name[: -len(".chunk")])
    return key if key is not None and key.hex()[:2] == hh else None
