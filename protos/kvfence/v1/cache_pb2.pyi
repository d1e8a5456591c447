from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Quotas(_message.Message):
    __slots__ = ("max_kv_pages", "max_concurrent_streams", "max_prompt_tokens", "tokens_per_minute", "prefix_cache_ttl_seconds")
    MAX_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_kv_pages: int
    max_concurrent_streams: int
    max_prompt_tokens: int
    tokens_per_minute: int
    prefix_cache_ttl_seconds: float
    def __init__(self, max_kv_pages: _Optional[int] = ..., max_concurrent_streams: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., tokens_per_minute: _Optional[int] = ..., prefix_cache_ttl_seconds: _Optional[float] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("pages_in_use", "pages_cached", "cached_prefixes", "prefix_hit_tokens", "prefix_miss_tokens", "hit_rate", "page_size", "running_requests", "quotas", "adapters", "shared_prefix_hit_tokens", "tier_hit_tokens", "tier_bytes")
    PAGES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    pages_in_use: int
    pages_cached: int
    cached_prefixes: int
    prefix_hit_tokens: int
    prefix_miss_tokens: int
    hit_rate: float
    page_size: int
    running_requests: int
    quotas: Quotas
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterUsage]
    shared_prefix_hit_tokens: int
    tier_hit_tokens: int
    tier_bytes: int
    def __init__(self, pages_in_use: _Optional[int] = ..., pages_cached: _Optional[int] = ..., cached_prefixes: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_miss_tokens: _Optional[int] = ..., hit_rate: _Optional[float] = ..., page_size: _Optional[int] = ..., running_requests: _Optional[int] = ..., quotas: _Optional[_Union[Quotas, _Mapping]] = ..., adapters: _Optional[_Iterable[_Union[AdapterUsage, _Mapping]]] = ..., shared_prefix_hit_tokens: _Optional[int] = ..., tier_hit_tokens: _Optional[int] = ..., tier_bytes: _Optional[int] = ...) -> None: ...

class AdapterUsage(_message.Message):
    __slots__ = ("name", "requests", "prompt_tokens", "completion_tokens", "resident")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    resident: bool
    def __init__(self, name: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., resident: _Optional[bool] = ...) -> None: ...

class PurgeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PurgeResponse(_message.Message):
    __slots__ = ("pages_purged",)
    PAGES_PURGED_FIELD_NUMBER: _ClassVar[int]
    pages_purged: int
    def __init__(self, pages_purged: _Optional[int] = ...) -> None: ...
