from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HistoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HISTORY_KIND_UNSPECIFIED: _ClassVar[HistoryKind]
    HISTORY_KIND_PAGED_KV: _ClassVar[HistoryKind]
    HISTORY_KIND_PAGED_LATENT: _ClassVar[HistoryKind]
    HISTORY_KIND_SLIDING_WINDOW: _ClassVar[HistoryKind]
    HISTORY_KIND_RECURRENT: _ClassVar[HistoryKind]
    HISTORY_KIND_CONTINUATION: _ClassVar[HistoryKind]

class Operation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_UNSPECIFIED: _ClassVar[Operation]
    OPERATION_INITIALIZE: _ClassVar[Operation]
    OPERATION_PREFILL: _ClassVar[Operation]
    OPERATION_SCORED_PREFILL: _ClassVar[Operation]
    OPERATION_RESUME: _ClassVar[Operation]
    OPERATION_DECODE: _ClassVar[Operation]
    OPERATION_SPECULATIVE: _ClassVar[Operation]
    OPERATION_MIXED: _ClassVar[Operation]
    OPERATION_SNAPSHOT: _ClassVar[Operation]
    OPERATION_RESTORE: _ClassVar[Operation]

class ValueSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_SOURCE_UNSPECIFIED: _ClassVar[ValueSource]
    VALUE_SOURCE_SLOT: _ClassVar[ValueSource]
    VALUE_SOURCE_GENERATION: _ClassVar[ValueSource]
    VALUE_SOURCE_LIVE_ROW_COUNT: _ClassVar[ValueSource]
    VALUE_SOURCE_QUERY_LENGTH: _ClassVar[ValueSource]
    VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT: _ClassVar[ValueSource]
    VALUE_SOURCE_SAMPLING_DECISION: _ClassVar[ValueSource]
    VALUE_SOURCE_MIXED_PREFILL_ROW: _ClassVar[ValueSource]
    VALUE_SOURCE_PROMPT_TOKENS: _ClassVar[ValueSource]
    VALUE_SOURCE_SCORED_PREFILL_TARGETS: _ClassVar[ValueSource]
    VALUE_SOURCE_PENDING_TOKEN: _ClassVar[ValueSource]
    VALUE_SOURCE_PROMPT_POSITIONS: _ClassVar[ValueSource]
    VALUE_SOURCE_IMAGE_FEATURE_INDICES: _ClassVar[ValueSource]
    VALUE_SOURCE_IMAGE_CONTEXT_INDICES: _ClassVar[ValueSource]
    VALUE_SOURCE_IMAGE_FEATURE_SLOT: _ClassVar[ValueSource]
    VALUE_SOURCE_TOKEN_ROW: _ClassVar[ValueSource]
    VALUE_SOURCE_PAGE_TABLE: _ClassVar[ValueSource]
    VALUE_SOURCE_LIVE_STATE_ROWS: _ClassVar[ValueSource]
    VALUE_SOURCE_RESTORE_SOURCE: _ClassVar[ValueSource]
    VALUE_SOURCE_SNAPSHOT_DESTINATION: _ClassVar[ValueSource]
    VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT: _ClassVar[ValueSource]
    VALUE_SOURCE_CACHE_SLOT: _ClassVar[ValueSource]
    VALUE_SOURCE_SEED_BITS: _ClassVar[ValueSource]
    VALUE_SOURCE_TEMPERATURE: _ClassVar[ValueSource]
    VALUE_SOURCE_TOP_P: _ClassVar[ValueSource]
    VALUE_SOURCE_TOP_K: _ClassVar[ValueSource]
    VALUE_SOURCE_MIN_P: _ClassVar[ValueSource]
    VALUE_SOURCE_REPETITION_PENALTY: _ClassVar[ValueSource]
    VALUE_SOURCE_FREQUENCY_PENALTY: _ClassVar[ValueSource]
    VALUE_SOURCE_PRESENCE_PENALTY: _ClassVar[ValueSource]
    VALUE_SOURCE_OUTPUT_LIMIT: _ClassVar[ValueSource]
    VALUE_SOURCE_EOS_IDS: _ClassVar[ValueSource]
    VALUE_SOURCE_PROMPT_HISTOGRAM: _ClassVar[ValueSource]
    VALUE_SOURCE_GRAMMAR_MASK: _ClassVar[ValueSource]
    VALUE_SOURCE_CONSTRAINED: _ClassVar[ValueSource]
    VALUE_SOURCE_SAMPLING_STEP: _ClassVar[ValueSource]
    VALUE_SOURCE_CANDIDATE_IDS: _ClassVar[ValueSource]
    VALUE_SOURCE_CANDIDATE_COUNT: _ClassVar[ValueSource]
    VALUE_SOURCE_CANDIDATE_GENERATION: _ClassVar[ValueSource]
    VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT: _ClassVar[ValueSource]
    VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS: _ClassVar[ValueSource]
    VALUE_SOURCE_CONSTANT: _ClassVar[ValueSource]
    VALUE_SOURCE_INACTIVE_PADDING: _ClassVar[ValueSource]
    VALUE_SOURCE_IMAGE_TENSOR: _ClassVar[ValueSource]

class Indexing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INDEXING_UNSPECIFIED: _ClassVar[Indexing]
    INDEXING_SCALAR: _ClassVar[Indexing]
    INDEXING_SUBMISSION_ROW: _ClassVar[Indexing]
    INDEXING_ACTIVE_ROW: _ClassVar[Indexing]
    INDEXING_PHYSICAL_REQUEST_ROW: _ClassVar[Indexing]
    INDEXING_PACKED_TOKEN: _ClassVar[Indexing]

class AccessMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCESS_MODE_UNSPECIFIED: _ClassVar[AccessMode]
    ACCESS_MODE_READ: _ClassVar[AccessMode]
    ACCESS_MODE_WRITE: _ClassVar[AccessMode]
    ACCESS_MODE_READ_WRITE: _ClassVar[AccessMode]

class ToolParser(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_PARSER_UNSPECIFIED: _ClassVar[ToolParser]
    TOOL_PARSER_NONE: _ClassVar[ToolParser]
    TOOL_PARSER_FUNCTION_TAGS: _ClassVar[ToolParser]
    TOOL_PARSER_ARGUMENT_TAGS: _ClassVar[ToolParser]
    TOOL_PARSER_DSML: _ClassVar[ToolParser]
    TOOL_PARSER_XTML: _ClassVar[ToolParser]
    TOOL_PARSER_ATEM: _ClassVar[ToolParser]
    TOOL_PARSER_JSON_TAGS: _ClassVar[ToolParser]

class ReasoningParser(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASONING_PARSER_UNSPECIFIED: _ClassVar[ReasoningParser]
    REASONING_PARSER_NONE: _ClassVar[ReasoningParser]
    REASONING_PARSER_THINK_TAGS: _ClassVar[ReasoningParser]
    REASONING_PARSER_XTML_THINK: _ClassVar[ReasoningParser]
    REASONING_PARSER_RECIPIENT_HEADER: _ClassVar[ReasoningParser]

class ImagePreparation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_PREPARATION_UNSPECIFIED: _ClassVar[ImagePreparation]
    IMAGE_PREPARATION_NONE: _ClassVar[ImagePreparation]
    IMAGE_PREPARATION_PATCH_GRID: _ClassVar[ImagePreparation]
    IMAGE_PREPARATION_FIXED_TILE: _ClassVar[ImagePreparation]

class ImageLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_LAYOUT_UNSPECIFIED: _ClassVar[ImageLayout]
    IMAGE_LAYOUT_NONE: _ClassVar[ImageLayout]
    IMAGE_LAYOUT_RASTER_SPAN: _ClassVar[ImageLayout]
    IMAGE_LAYOUT_MERGED_GRID: _ClassVar[ImageLayout]

class MessageRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MESSAGE_ROLE_UNSPECIFIED: _ClassVar[MessageRole]
    MESSAGE_ROLE_SYSTEM: _ClassVar[MessageRole]
    MESSAGE_ROLE_USER: _ClassVar[MessageRole]
    MESSAGE_ROLE_ASSISTANT: _ClassVar[MessageRole]
    MESSAGE_ROLE_TOOL: _ClassVar[MessageRole]
    MESSAGE_ROLE_DEVELOPER: _ClassVar[MessageRole]

class RenderingConstraint(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RENDERING_CONSTRAINT_UNSPECIFIED: _ClassVar[RenderingConstraint]
    RENDERING_CONSTRAINT_INDEPENDENT: _ClassVar[RenderingConstraint]
    RENDERING_CONSTRAINT_INDEPENDENT_WITHOUT_TOOLS: _ClassVar[RenderingConstraint]
    RENDERING_CONSTRAINT_INDEPENDENT_UNLESS_REASONING_STRIPPED: _ClassVar[RenderingConstraint]
HISTORY_KIND_UNSPECIFIED: HistoryKind
HISTORY_KIND_PAGED_KV: HistoryKind
HISTORY_KIND_PAGED_LATENT: HistoryKind
HISTORY_KIND_SLIDING_WINDOW: HistoryKind
HISTORY_KIND_RECURRENT: HistoryKind
HISTORY_KIND_CONTINUATION: HistoryKind
OPERATION_UNSPECIFIED: Operation
OPERATION_INITIALIZE: Operation
OPERATION_PREFILL: Operation
OPERATION_SCORED_PREFILL: Operation
OPERATION_RESUME: Operation
OPERATION_DECODE: Operation
OPERATION_SPECULATIVE: Operation
OPERATION_MIXED: Operation
OPERATION_SNAPSHOT: Operation
OPERATION_RESTORE: Operation
VALUE_SOURCE_UNSPECIFIED: ValueSource
VALUE_SOURCE_SLOT: ValueSource
VALUE_SOURCE_GENERATION: ValueSource
VALUE_SOURCE_LIVE_ROW_COUNT: ValueSource
VALUE_SOURCE_QUERY_LENGTH: ValueSource
VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT: ValueSource
VALUE_SOURCE_SAMPLING_DECISION: ValueSource
VALUE_SOURCE_MIXED_PREFILL_ROW: ValueSource
VALUE_SOURCE_PROMPT_TOKENS: ValueSource
VALUE_SOURCE_SCORED_PREFILL_TARGETS: ValueSource
VALUE_SOURCE_PENDING_TOKEN: ValueSource
VALUE_SOURCE_PROMPT_POSITIONS: ValueSource
VALUE_SOURCE_IMAGE_FEATURE_INDICES: ValueSource
VALUE_SOURCE_IMAGE_CONTEXT_INDICES: ValueSource
VALUE_SOURCE_IMAGE_FEATURE_SLOT: ValueSource
VALUE_SOURCE_TOKEN_ROW: ValueSource
VALUE_SOURCE_PAGE_TABLE: ValueSource
VALUE_SOURCE_LIVE_STATE_ROWS: ValueSource
VALUE_SOURCE_RESTORE_SOURCE: ValueSource
VALUE_SOURCE_SNAPSHOT_DESTINATION: ValueSource
VALUE_SOURCE_CONSUMED_TOKEN_ENDPOINT: ValueSource
VALUE_SOURCE_CACHE_SLOT: ValueSource
VALUE_SOURCE_SEED_BITS: ValueSource
VALUE_SOURCE_TEMPERATURE: ValueSource
VALUE_SOURCE_TOP_P: ValueSource
VALUE_SOURCE_TOP_K: ValueSource
VALUE_SOURCE_MIN_P: ValueSource
VALUE_SOURCE_REPETITION_PENALTY: ValueSource
VALUE_SOURCE_FREQUENCY_PENALTY: ValueSource
VALUE_SOURCE_PRESENCE_PENALTY: ValueSource
VALUE_SOURCE_OUTPUT_LIMIT: ValueSource
VALUE_SOURCE_EOS_IDS: ValueSource
VALUE_SOURCE_PROMPT_HISTOGRAM: ValueSource
VALUE_SOURCE_GRAMMAR_MASK: ValueSource
VALUE_SOURCE_CONSTRAINED: ValueSource
VALUE_SOURCE_SAMPLING_STEP: ValueSource
VALUE_SOURCE_CANDIDATE_IDS: ValueSource
VALUE_SOURCE_CANDIDATE_COUNT: ValueSource
VALUE_SOURCE_CANDIDATE_GENERATION: ValueSource
VALUE_SOURCE_CANDIDATE_CONSUMED_ENDPOINT: ValueSource
VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS: ValueSource
VALUE_SOURCE_CONSTANT: ValueSource
VALUE_SOURCE_INACTIVE_PADDING: ValueSource
VALUE_SOURCE_IMAGE_TENSOR: ValueSource
INDEXING_UNSPECIFIED: Indexing
INDEXING_SCALAR: Indexing
INDEXING_SUBMISSION_ROW: Indexing
INDEXING_ACTIVE_ROW: Indexing
INDEXING_PHYSICAL_REQUEST_ROW: Indexing
INDEXING_PACKED_TOKEN: Indexing
ACCESS_MODE_UNSPECIFIED: AccessMode
ACCESS_MODE_READ: AccessMode
ACCESS_MODE_WRITE: AccessMode
ACCESS_MODE_READ_WRITE: AccessMode
TOOL_PARSER_UNSPECIFIED: ToolParser
TOOL_PARSER_NONE: ToolParser
TOOL_PARSER_FUNCTION_TAGS: ToolParser
TOOL_PARSER_ARGUMENT_TAGS: ToolParser
TOOL_PARSER_DSML: ToolParser
TOOL_PARSER_XTML: ToolParser
TOOL_PARSER_ATEM: ToolParser
TOOL_PARSER_JSON_TAGS: ToolParser
REASONING_PARSER_UNSPECIFIED: ReasoningParser
REASONING_PARSER_NONE: ReasoningParser
REASONING_PARSER_THINK_TAGS: ReasoningParser
REASONING_PARSER_XTML_THINK: ReasoningParser
REASONING_PARSER_RECIPIENT_HEADER: ReasoningParser
IMAGE_PREPARATION_UNSPECIFIED: ImagePreparation
IMAGE_PREPARATION_NONE: ImagePreparation
IMAGE_PREPARATION_PATCH_GRID: ImagePreparation
IMAGE_PREPARATION_FIXED_TILE: ImagePreparation
IMAGE_LAYOUT_UNSPECIFIED: ImageLayout
IMAGE_LAYOUT_NONE: ImageLayout
IMAGE_LAYOUT_RASTER_SPAN: ImageLayout
IMAGE_LAYOUT_MERGED_GRID: ImageLayout
MESSAGE_ROLE_UNSPECIFIED: MessageRole
MESSAGE_ROLE_SYSTEM: MessageRole
MESSAGE_ROLE_USER: MessageRole
MESSAGE_ROLE_ASSISTANT: MessageRole
MESSAGE_ROLE_TOOL: MessageRole
MESSAGE_ROLE_DEVELOPER: MessageRole
RENDERING_CONSTRAINT_UNSPECIFIED: RenderingConstraint
RENDERING_CONSTRAINT_INDEPENDENT: RenderingConstraint
RENDERING_CONSTRAINT_INDEPENDENT_WITHOUT_TOOLS: RenderingConstraint
RENDERING_CONSTRAINT_INDEPENDENT_UNLESS_REASONING_STRIPPED: RenderingConstraint

class ServingContract(_message.Message):
    __slots__ = ("served_name", "aliases", "cache_identity", "context_tokens", "prefill_tokens", "page_capacity", "snapshot_capacity", "max_concurrency", "speculative_widths", "defaults", "model", "learned_speculation")
    SERVED_NAME_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    CACHE_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_WIDTHS_FIELD_NUMBER: _ClassVar[int]
    DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LEARNED_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    served_name: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    cache_identity: str
    context_tokens: int
    prefill_tokens: int
    page_capacity: int
    snapshot_capacity: int
    max_concurrency: int
    speculative_widths: _containers.RepeatedScalarFieldContainer[int]
    defaults: ServingDefaults
    model: ModelContract
    learned_speculation: bool
    def __init__(self, served_name: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., cache_identity: _Optional[str] = ..., context_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., page_capacity: _Optional[int] = ..., snapshot_capacity: _Optional[int] = ..., max_concurrency: _Optional[int] = ..., speculative_widths: _Optional[_Iterable[int]] = ..., defaults: _Optional[_Union[ServingDefaults, _Mapping]] = ..., model: _Optional[_Union[ModelContract, _Mapping]] = ..., learned_speculation: _Optional[bool] = ...) -> None: ...

class ServingDefaults(_message.Message):
    __slots__ = ("sampling", "max_output_tokens", "eos_token_ids", "queue_capacity", "max_active", "frontend_workers", "event_capacity")
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_WORKERS_FIELD_NUMBER: _ClassVar[int]
    EVENT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    sampling: SamplingDefaults
    max_output_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    queue_capacity: int
    max_active: int
    frontend_workers: int
    event_capacity: int
    def __init__(self, sampling: _Optional[_Union[SamplingDefaults, _Mapping]] = ..., max_output_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., queue_capacity: _Optional[int] = ..., max_active: _Optional[int] = ..., frontend_workers: _Optional[int] = ..., event_capacity: _Optional[int] = ...) -> None: ...

class SamplingDefaults(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ...) -> None: ...

class ModelContract(_message.Message):
    __slots__ = ("version", "vocabulary", "input_vocabulary", "vision", "cache", "graphs", "frontend", "state_views")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    INPUT_VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    STATE_VIEWS_FIELD_NUMBER: _ClassVar[int]
    version: int
    vocabulary: VocabularyContract
    input_vocabulary: InputVocabularyContract
    vision: VisionContract
    cache: CacheContract
    graphs: _containers.RepeatedCompositeFieldContainer[GraphContract]
    frontend: FrontendContract
    state_views: _containers.RepeatedCompositeFieldContainer[StateView]
    def __init__(self, version: _Optional[int] = ..., vocabulary: _Optional[_Union[VocabularyContract, _Mapping]] = ..., input_vocabulary: _Optional[_Union[InputVocabularyContract, _Mapping]] = ..., vision: _Optional[_Union[VisionContract, _Mapping]] = ..., cache: _Optional[_Union[CacheContract, _Mapping]] = ..., graphs: _Optional[_Iterable[_Union[GraphContract, _Mapping]]] = ..., frontend: _Optional[_Union[FrontendContract, _Mapping]] = ..., state_views: _Optional[_Iterable[_Union[StateView, _Mapping]]] = ...) -> None: ...

class VocabularyContract(_message.Message):
    __slots__ = ("sampled_size", "logits_width", "histogram_width", "mask_words")
    SAMPLED_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGITS_WIDTH_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MASK_WORDS_FIELD_NUMBER: _ClassVar[int]
    sampled_size: int
    logits_width: int
    histogram_width: int
    mask_words: int
    def __init__(self, sampled_size: _Optional[int] = ..., logits_width: _Optional[int] = ..., histogram_width: _Optional[int] = ..., mask_words: _Optional[int] = ...) -> None: ...

class InputVocabularyContract(_message.Message):
    __slots__ = ("size", "image_sentinel_ids")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SENTINEL_IDS_FIELD_NUMBER: _ClassVar[int]
    size: int
    image_sentinel_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, size: _Optional[int] = ..., image_sentinel_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VisionContract(_message.Message):
    __slots__ = ("feature_slots", "features_per_window", "patches_per_feature", "patch_capacities", "token_layout", "settings")
    FEATURE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_PER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PATCHES_PER_FEATURE_FIELD_NUMBER: _ClassVar[int]
    PATCH_CAPACITIES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    feature_slots: int
    features_per_window: int
    patches_per_feature: int
    patch_capacities: _containers.RepeatedScalarFieldContainer[int]
    token_layout: ImageTokenLayout
    settings: ImageSettings
    def __init__(self, feature_slots: _Optional[int] = ..., features_per_window: _Optional[int] = ..., patches_per_feature: _Optional[int] = ..., patch_capacities: _Optional[_Iterable[int]] = ..., token_layout: _Optional[_Union[ImageTokenLayout, _Mapping]] = ..., settings: _Optional[_Union[ImageSettings, _Mapping]] = ...) -> None: ...

class ImageTokenLayout(_message.Message):
    __slots__ = ("feature_ids", "atomic_spans")
    FEATURE_IDS_FIELD_NUMBER: _ClassVar[int]
    ATOMIC_SPANS_FIELD_NUMBER: _ClassVar[int]
    feature_ids: _containers.RepeatedScalarFieldContainer[int]
    atomic_spans: _containers.RepeatedCompositeFieldContainer[AtomicSpan]
    def __init__(self, feature_ids: _Optional[_Iterable[int]] = ..., atomic_spans: _Optional[_Iterable[_Union[AtomicSpan, _Mapping]]] = ...) -> None: ...

class AtomicSpan(_message.Message):
    __slots__ = ("open_id", "close_id")
    OPEN_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSE_ID_FIELD_NUMBER: _ClassVar[int]
    open_id: int
    close_id: int
    def __init__(self, open_id: _Optional[int] = ..., close_id: _Optional[int] = ...) -> None: ...

class ImageSettings(_message.Message):
    __slots__ = ("patch_size", "min_pixels", "max_pixels", "mean", "std", "temporal_patch")
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_PATCH_FIELD_NUMBER: _ClassVar[int]
    patch_size: int
    min_pixels: int
    max_pixels: int
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    temporal_patch: int
    def __init__(self, patch_size: _Optional[int] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ..., temporal_patch: _Optional[int] = ...) -> None: ...

class CacheContract(_message.Message):
    __slots__ = ("page_tokens", "regions", "page_table_views")
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TABLE_VIEWS_FIELD_NUMBER: _ClassVar[int]
    page_tokens: int
    regions: _containers.RepeatedCompositeFieldContainer[HistoryRegion]
    page_table_views: _containers.RepeatedCompositeFieldContainer[PageTableView]
    def __init__(self, page_tokens: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[HistoryRegion, _Mapping]]] = ..., page_table_views: _Optional[_Iterable[_Union[PageTableView, _Mapping]]] = ...) -> None: ...

class HistoryRegion(_message.Message):
    __slots__ = ("name", "kind", "planes", "tokens_per_record", "window_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_RECORD_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: HistoryKind
    planes: _containers.RepeatedScalarFieldContainer[str]
    tokens_per_record: int
    window_tokens: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[HistoryKind, str]] = ..., planes: _Optional[_Iterable[str]] = ..., tokens_per_record: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class PageTableView(_message.Message):
    __slots__ = ("buffer", "page_offset", "region", "pages_per_row")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    PAGES_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    page_offset: int
    region: str
    pages_per_row: int
    def __init__(self, buffer: _Optional[str] = ..., page_offset: _Optional[int] = ..., region: _Optional[str] = ..., pages_per_row: _Optional[int] = ...) -> None: ...

class GraphContract(_message.Message):
    __slots__ = ("name", "operation", "resource_dependencies", "bindings", "state_accesses", "tuned_bindings", "extents", "confidence_width", "state_rows_per_request", "cursor", "rng_reservations", "pending_token", "logprobs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_DEPENDENCIES_FIELD_NUMBER: _ClassVar[int]
    BINDINGS_FIELD_NUMBER: _ClassVar[int]
    STATE_ACCESSES_FIELD_NUMBER: _ClassVar[int]
    TUNED_BINDINGS_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    STATE_ROWS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    RNG_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    name: str
    operation: Operation
    resource_dependencies: _containers.RepeatedScalarFieldContainer[str]
    bindings: _containers.RepeatedCompositeFieldContainer[ValueBinding]
    state_accesses: _containers.RepeatedCompositeFieldContainer[StateAccess]
    tuned_bindings: _containers.RepeatedCompositeFieldContainer[TunedBinding]
    extents: GraphExtents
    confidence_width: int
    state_rows_per_request: int
    cursor: CompletionCursor
    rng_reservations: _containers.RepeatedCompositeFieldContainer[RngReservation]
    pending_token: PendingTokenSource
    logprobs: LogprobOutputs
    def __init__(self, name: _Optional[str] = ..., operation: _Optional[_Union[Operation, str]] = ..., resource_dependencies: _Optional[_Iterable[str]] = ..., bindings: _Optional[_Iterable[_Union[ValueBinding, _Mapping]]] = ..., state_accesses: _Optional[_Iterable[_Union[StateAccess, _Mapping]]] = ..., tuned_bindings: _Optional[_Iterable[_Union[TunedBinding, _Mapping]]] = ..., extents: _Optional[_Union[GraphExtents, _Mapping]] = ..., confidence_width: _Optional[int] = ..., state_rows_per_request: _Optional[int] = ..., cursor: _Optional[_Union[CompletionCursor, _Mapping]] = ..., rng_reservations: _Optional[_Iterable[_Union[RngReservation, _Mapping]]] = ..., pending_token: _Optional[_Union[PendingTokenSource, _Mapping]] = ..., logprobs: _Optional[_Union[LogprobOutputs, _Mapping]] = ...) -> None: ...

class GraphExtents(_message.Message):
    __slots__ = ("batch_capacity", "token_capacity", "packed_token_capacity", "draft_tokens", "verify_tokens", "draft_capacity")
    BATCH_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    batch_capacity: int
    token_capacity: int
    packed_token_capacity: int
    draft_tokens: int
    verify_tokens: int
    draft_capacity: int
    def __init__(self, batch_capacity: _Optional[int] = ..., token_capacity: _Optional[int] = ..., packed_token_capacity: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., verify_tokens: _Optional[int] = ..., draft_capacity: _Optional[int] = ...) -> None: ...

class ValueBinding(_message.Message):
    __slots__ = ("destination", "source", "indexing", "offset", "padding", "constant", "image_output")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    INDEXING_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    CONSTANT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    destination: str
    source: ValueSource
    indexing: Indexing
    offset: int
    padding: int
    constant: int
    image_output: str
    def __init__(self, destination: _Optional[str] = ..., source: _Optional[_Union[ValueSource, str]] = ..., indexing: _Optional[_Union[Indexing, str]] = ..., offset: _Optional[int] = ..., padding: _Optional[int] = ..., constant: _Optional[int] = ..., image_output: _Optional[str] = ...) -> None: ...

class StateView(_message.Message):
    __slots__ = ("name", "buffer", "byte_offset", "row_stride", "byte_extent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROW_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BYTE_EXTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    buffer: str
    byte_offset: int
    row_stride: int
    byte_extent: int
    def __init__(self, name: _Optional[str] = ..., buffer: _Optional[str] = ..., byte_offset: _Optional[int] = ..., row_stride: _Optional[int] = ..., byte_extent: _Optional[int] = ...) -> None: ...

class StateAccess(_message.Message):
    __slots__ = ("view", "mode")
    VIEW_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    view: str
    mode: AccessMode
    def __init__(self, view: _Optional[str] = ..., mode: _Optional[_Union[AccessMode, str]] = ...) -> None: ...

class TunedBinding(_message.Message):
    __slots__ = ("buffer", "producer")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    producer: str
    def __init__(self, buffer: _Optional[str] = ..., producer: _Optional[str] = ...) -> None: ...

class CompletionCursor(_message.Message):
    __slots__ = ("reports_draft_cursor", "lag_tokens")
    REPORTS_DRAFT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    LAG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reports_draft_cursor: bool
    lag_tokens: int
    def __init__(self, reports_draft_cursor: _Optional[bool] = ..., lag_tokens: _Optional[int] = ...) -> None: ...

class RngReservation(_message.Message):
    __slots__ = ("stream", "draws_per_row")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DRAWS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    stream: str
    draws_per_row: int
    def __init__(self, stream: _Optional[str] = ..., draws_per_row: _Optional[int] = ...) -> None: ...

class PendingTokenSource(_message.Message):
    __slots__ = ("state_view", "binding_destination")
    STATE_VIEW_FIELD_NUMBER: _ClassVar[int]
    BINDING_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    state_view: str
    binding_destination: str
    def __init__(self, state_view: _Optional[str] = ..., binding_destination: _Optional[str] = ...) -> None: ...

class LogprobOutputs(_message.Message):
    __slots__ = ("sampled", "top_n")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    sampled: bool
    top_n: int
    def __init__(self, sampled: _Optional[bool] = ..., top_n: _Optional[int] = ...) -> None: ...

class PrefixBoundaryRule(_message.Message):
    __slots__ = ("roles", "constraint")
    ROLES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    roles: _containers.RepeatedScalarFieldContainer[MessageRole]
    constraint: RenderingConstraint
    def __init__(self, roles: _Optional[_Iterable[_Union[MessageRole, str]]] = ..., constraint: _Optional[_Union[RenderingConstraint, str]] = ...) -> None: ...

class FrontendContract(_message.Message):
    __slots__ = ("tool_parser", "reasoning_parser", "image_preparation", "image_layout", "tool_syntax", "reasoning_syntax", "prefix_boundaries", "template_tokens", "template_variables", "plugin_parameters_json")
    TOOL_PARSER_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PREPARATION_FIELD_NUMBER: _ClassVar[int]
    IMAGE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOOL_SYNTAX_FIELD_NUMBER: _ClassVar[int]
    REASONING_SYNTAX_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_VARIABLES_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    tool_parser: ToolParser
    reasoning_parser: ReasoningParser
    image_preparation: ImagePreparation
    image_layout: ImageLayout
    tool_syntax: ToolSyntax
    reasoning_syntax: ReasoningSyntax
    prefix_boundaries: _containers.RepeatedCompositeFieldContainer[PrefixBoundaryRule]
    template_tokens: TemplateTokens
    template_variables: _containers.RepeatedCompositeFieldContainer[TemplateVariable]
    plugin_parameters_json: str
    def __init__(self, tool_parser: _Optional[_Union[ToolParser, str]] = ..., reasoning_parser: _Optional[_Union[ReasoningParser, str]] = ..., image_preparation: _Optional[_Union[ImagePreparation, str]] = ..., image_layout: _Optional[_Union[ImageLayout, str]] = ..., tool_syntax: _Optional[_Union[ToolSyntax, _Mapping]] = ..., reasoning_syntax: _Optional[_Union[ReasoningSyntax, _Mapping]] = ..., prefix_boundaries: _Optional[_Iterable[_Union[PrefixBoundaryRule, _Mapping]]] = ..., template_tokens: _Optional[_Union[TemplateTokens, _Mapping]] = ..., template_variables: _Optional[_Iterable[_Union[TemplateVariable, _Mapping]]] = ..., plugin_parameters_json: _Optional[str] = ...) -> None: ...

class TemplateTokens(_message.Message):
    __slots__ = ("bos", "message_end", "assistant_open", "tool_response_open", "control_tokens")
    BOS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_END_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_OPEN_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESPONSE_OPEN_FIELD_NUMBER: _ClassVar[int]
    CONTROL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    bos: str
    message_end: str
    assistant_open: str
    tool_response_open: str
    control_tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, bos: _Optional[str] = ..., message_end: _Optional[str] = ..., assistant_open: _Optional[str] = ..., tool_response_open: _Optional[str] = ..., control_tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class TemplateVariable(_message.Message):
    __slots__ = ("name", "json_value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    JSON_VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    json_value: str
    def __init__(self, name: _Optional[str] = ..., json_value: _Optional[str] = ...) -> None: ...

class ReasoningSyntax(_message.Message):
    __slots__ = ("open", "close", "wrapping_newlines", "terminal_marker", "recipient_header")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    WRAPPING_NEWLINES_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_MARKER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_HEADER_FIELD_NUMBER: _ClassVar[int]
    open: str
    close: str
    wrapping_newlines: bool
    terminal_marker: str
    recipient_header: RecipientHeaderSyntax
    def __init__(self, open: _Optional[str] = ..., close: _Optional[str] = ..., wrapping_newlines: _Optional[bool] = ..., terminal_marker: _Optional[str] = ..., recipient_header: _Optional[_Union[RecipientHeaderSyntax, _Mapping]] = ...) -> None: ...

class RecipientHeaderSyntax(_message.Message):
    __slots__ = ("start", "assistant_role", "recipient_prefix", "message", "end", "end_of_message", "reasoning_recipient", "content_recipients", "generic_tool_recipient", "named_tool_prefix")
    START_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_ROLE_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    END_OF_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASONING_RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    GENERIC_TOOL_RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    NAMED_TOOL_PREFIX_FIELD_NUMBER: _ClassVar[int]
    start: str
    assistant_role: str
    recipient_prefix: str
    message: str
    end: str
    end_of_message: str
    reasoning_recipient: str
    content_recipients: _containers.RepeatedScalarFieldContainer[str]
    generic_tool_recipient: str
    named_tool_prefix: str
    def __init__(self, start: _Optional[str] = ..., assistant_role: _Optional[str] = ..., recipient_prefix: _Optional[str] = ..., message: _Optional[str] = ..., end: _Optional[str] = ..., end_of_message: _Optional[str] = ..., reasoning_recipient: _Optional[str] = ..., content_recipients: _Optional[_Iterable[str]] = ..., generic_tool_recipient: _Optional[str] = ..., named_tool_prefix: _Optional[str] = ...) -> None: ...

class ToolSyntax(_message.Message):
    __slots__ = ("opener", "function_tags", "argument_tags", "dsml", "xtml", "atem", "json_tags")
    OPENER_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_TAGS_FIELD_NUMBER: _ClassVar[int]
    ARGUMENT_TAGS_FIELD_NUMBER: _ClassVar[int]
    DSML_FIELD_NUMBER: _ClassVar[int]
    XTML_FIELD_NUMBER: _ClassVar[int]
    ATEM_FIELD_NUMBER: _ClassVar[int]
    JSON_TAGS_FIELD_NUMBER: _ClassVar[int]
    opener: str
    function_tags: FunctionTagSyntax
    argument_tags: ArgumentTagSyntax
    dsml: DsmlSyntax
    xtml: XtmlSyntax
    atem: AtemSyntax
    json_tags: JsonTagSyntax
    def __init__(self, opener: _Optional[str] = ..., function_tags: _Optional[_Union[FunctionTagSyntax, _Mapping]] = ..., argument_tags: _Optional[_Union[ArgumentTagSyntax, _Mapping]] = ..., dsml: _Optional[_Union[DsmlSyntax, _Mapping]] = ..., xtml: _Optional[_Union[XtmlSyntax, _Mapping]] = ..., atem: _Optional[_Union[AtemSyntax, _Mapping]] = ..., json_tags: _Optional[_Union[JsonTagSyntax, _Mapping]] = ...) -> None: ...

class FunctionTagSyntax(_message.Message):
    __slots__ = ("call_open", "call_close", "function_prefix", "function_close", "parameter_prefix", "parameter_close", "wrapping_newlines")
    CALL_OPEN_FIELD_NUMBER: _ClassVar[int]
    CALL_CLOSE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_PREFIX_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_CLOSE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_CLOSE_FIELD_NUMBER: _ClassVar[int]
    WRAPPING_NEWLINES_FIELD_NUMBER: _ClassVar[int]
    call_open: str
    call_close: str
    function_prefix: str
    function_close: str
    parameter_prefix: str
    parameter_close: str
    wrapping_newlines: bool
    def __init__(self, call_open: _Optional[str] = ..., call_close: _Optional[str] = ..., function_prefix: _Optional[str] = ..., function_close: _Optional[str] = ..., parameter_prefix: _Optional[str] = ..., parameter_close: _Optional[str] = ..., wrapping_newlines: _Optional[bool] = ...) -> None: ...

class ArgumentTagSyntax(_message.Message):
    __slots__ = ("call_open", "call_close", "key_open", "key_close", "value_open", "value_close", "name_separator")
    CALL_OPEN_FIELD_NUMBER: _ClassVar[int]
    CALL_CLOSE_FIELD_NUMBER: _ClassVar[int]
    KEY_OPEN_FIELD_NUMBER: _ClassVar[int]
    KEY_CLOSE_FIELD_NUMBER: _ClassVar[int]
    VALUE_OPEN_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLOSE_FIELD_NUMBER: _ClassVar[int]
    NAME_SEPARATOR_FIELD_NUMBER: _ClassVar[int]
    call_open: str
    call_close: str
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    name_separator: str
    def __init__(self, call_open: _Optional[str] = ..., call_close: _Optional[str] = ..., key_open: _Optional[str] = ..., key_close: _Optional[str] = ..., value_open: _Optional[str] = ..., value_close: _Optional[str] = ..., name_separator: _Optional[str] = ...) -> None: ...

class DsmlSyntax(_message.Message):
    __slots__ = ("marker", "block", "invoke", "parameter", "block_separator")
    MARKER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    INVOKE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SEPARATOR_FIELD_NUMBER: _ClassVar[int]
    marker: str
    block: str
    invoke: str
    parameter: str
    block_separator: str
    def __init__(self, marker: _Optional[str] = ..., block: _Optional[str] = ..., invoke: _Optional[str] = ..., parameter: _Optional[str] = ..., block_separator: _Optional[str] = ...) -> None: ...

class XtmlSyntax(_message.Message):
    __slots__ = ("block_open", "block_close", "call_element", "arg_element", "think_element")
    BLOCK_OPEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CLOSE_FIELD_NUMBER: _ClassVar[int]
    CALL_ELEMENT_FIELD_NUMBER: _ClassVar[int]
    ARG_ELEMENT_FIELD_NUMBER: _ClassVar[int]
    THINK_ELEMENT_FIELD_NUMBER: _ClassVar[int]
    block_open: str
    block_close: str
    call_element: str
    arg_element: str
    think_element: str
    def __init__(self, block_open: _Optional[str] = ..., block_close: _Optional[str] = ..., call_element: _Optional[str] = ..., arg_element: _Optional[str] = ..., think_element: _Optional[str] = ...) -> None: ...

class AtemSyntax(_message.Message):
    __slots__ = ("prefix", "block", "invoke", "parameter")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    INVOKE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    block: str
    invoke: str
    parameter: str
    def __init__(self, prefix: _Optional[str] = ..., block: _Optional[str] = ..., invoke: _Optional[str] = ..., parameter: _Optional[str] = ...) -> None: ...

class JsonTagSyntax(_message.Message):
    __slots__ = ("call_open", "call_close")
    CALL_OPEN_FIELD_NUMBER: _ClassVar[int]
    CALL_CLOSE_FIELD_NUMBER: _ClassVar[int]
    call_open: str
    call_close: str
    def __init__(self, call_open: _Optional[str] = ..., call_close: _Optional[str] = ...) -> None: ...
