from helios_core.wire import contract_pb2 as _contract_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_F32: _ClassVar[DType]
    DTYPE_F16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
    DTYPE_I32: _ClassVar[DType]
    DTYPE_I64: _ClassVar[DType]
    DTYPE_U8: _ClassVar[DType]
    DTYPE_U32: _ClassVar[DType]
    DTYPE_U64: _ClassVar[DType]
    DTYPE_F64: _ClassVar[DType]

class BufferRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUFFER_ROLE_UNSPECIFIED: _ClassVar[BufferRole]
    BUFFER_ROLE_WEIGHTS: _ClassVar[BufferRole]
    BUFFER_ROLE_CACHE_PLANE: _ClassVar[BufferRole]
    BUFFER_ROLE_PERSISTENT_STATE: _ClassVar[BufferRole]
    BUFFER_ROLE_TRANSPORT: _ClassVar[BufferRole]
    BUFFER_ROLE_COMPLETION: _ClassVar[BufferRole]
    BUFFER_ROLE_SCRATCH: _ClassVar[BufferRole]
    BUFFER_ROLE_TUNED: _ClassVar[BufferRole]

class DimSymbol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIM_SYMBOL_UNSPECIFIED: _ClassVar[DimSymbol]
    DIM_SYMBOL_CACHE_PAGES: _ClassVar[DimSymbol]
    DIM_SYMBOL_STATE_ROWS: _ClassVar[DimSymbol]
    DIM_SYMBOL_SNAPSHOT_ROWS: _ClassVar[DimSymbol]

class ModuleFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODULE_FORMAT_UNSPECIFIED: _ClassVar[ModuleFormat]
    MODULE_FORMAT_CUBIN: _ClassVar[ModuleFormat]
    MODULE_FORMAT_PTX: _ClassVar[ModuleFormat]

class ParamKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARAM_KIND_UNSPECIFIED: _ClassVar[ParamKind]
    PARAM_KIND_ADDRESS: _ClassVar[ParamKind]
    PARAM_KIND_I32: _ClassVar[ParamKind]
    PARAM_KIND_I64: _ClassVar[ParamKind]
    PARAM_KIND_F32: _ClassVar[ParamKind]

class CompletionField(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPLETION_FIELD_UNSPECIFIED: _ClassVar[CompletionField]
    COMPLETION_FIELD_SUBMISSION_SEQUENCE: _ClassVar[CompletionField]
    COMPLETION_FIELD_GENERATION: _ClassVar[CompletionField]
    COMPLETION_FIELD_SAMPLED_IDS: _ClassVar[CompletionField]
    COMPLETION_FIELD_OFFERS: _ClassVar[CompletionField]
    COMPLETION_FIELD_ACCEPTED_DRAFTS: _ClassVar[CompletionField]
    COMPLETION_FIELD_EMITTED_TOKENS: _ClassVar[CompletionField]
    COMPLETION_FIELD_CONSUMED_TOKENS: _ClassVar[CompletionField]
    COMPLETION_FIELD_DRAFT_CURSOR: _ClassVar[CompletionField]
    COMPLETION_FIELD_RESERVED: _ClassVar[CompletionField]
    COMPLETION_FIELD_SAMPLED_LOGPROBS: _ClassVar[CompletionField]
    COMPLETION_FIELD_TOP_IDS: _ClassVar[CompletionField]
    COMPLETION_FIELD_TOP_LOGPROBS: _ClassVar[CompletionField]
    COMPLETION_FIELD_PROMPT_SCORES: _ClassVar[CompletionField]
    COMPLETION_FIELD_PROPOSAL_CONFIDENCE: _ClassVar[CompletionField]
    COMPLETION_FIELD_STATUS: _ClassVar[CompletionField]
DTYPE_UNSPECIFIED: DType
DTYPE_F32: DType
DTYPE_F16: DType
DTYPE_BF16: DType
DTYPE_I32: DType
DTYPE_I64: DType
DTYPE_U8: DType
DTYPE_U32: DType
DTYPE_U64: DType
DTYPE_F64: DType
BUFFER_ROLE_UNSPECIFIED: BufferRole
BUFFER_ROLE_WEIGHTS: BufferRole
BUFFER_ROLE_CACHE_PLANE: BufferRole
BUFFER_ROLE_PERSISTENT_STATE: BufferRole
BUFFER_ROLE_TRANSPORT: BufferRole
BUFFER_ROLE_COMPLETION: BufferRole
BUFFER_ROLE_SCRATCH: BufferRole
BUFFER_ROLE_TUNED: BufferRole
DIM_SYMBOL_UNSPECIFIED: DimSymbol
DIM_SYMBOL_CACHE_PAGES: DimSymbol
DIM_SYMBOL_STATE_ROWS: DimSymbol
DIM_SYMBOL_SNAPSHOT_ROWS: DimSymbol
MODULE_FORMAT_UNSPECIFIED: ModuleFormat
MODULE_FORMAT_CUBIN: ModuleFormat
MODULE_FORMAT_PTX: ModuleFormat
PARAM_KIND_UNSPECIFIED: ParamKind
PARAM_KIND_ADDRESS: ParamKind
PARAM_KIND_I32: ParamKind
PARAM_KIND_I64: ParamKind
PARAM_KIND_F32: ParamKind
COMPLETION_FIELD_UNSPECIFIED: CompletionField
COMPLETION_FIELD_SUBMISSION_SEQUENCE: CompletionField
COMPLETION_FIELD_GENERATION: CompletionField
COMPLETION_FIELD_SAMPLED_IDS: CompletionField
COMPLETION_FIELD_OFFERS: CompletionField
COMPLETION_FIELD_ACCEPTED_DRAFTS: CompletionField
COMPLETION_FIELD_EMITTED_TOKENS: CompletionField
COMPLETION_FIELD_CONSUMED_TOKENS: CompletionField
COMPLETION_FIELD_DRAFT_CURSOR: CompletionField
COMPLETION_FIELD_RESERVED: CompletionField
COMPLETION_FIELD_SAMPLED_LOGPROBS: CompletionField
COMPLETION_FIELD_TOP_IDS: CompletionField
COMPLETION_FIELD_TOP_LOGPROBS: CompletionField
COMPLETION_FIELD_PROMPT_SCORES: CompletionField
COMPLETION_FIELD_PROPOSAL_CONFIDENCE: CompletionField
COMPLETION_FIELD_STATUS: CompletionField

class Dim(_message.Message):
    __slots__ = ("size", "symbol")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SYMBOL_FIELD_NUMBER: _ClassVar[int]
    size: int
    symbol: DimSymbol
    def __init__(self, size: _Optional[int] = ..., symbol: _Optional[_Union[DimSymbol, str]] = ...) -> None: ...

class BufferDecl(_message.Message):
    __slots__ = ("name", "role", "dtype", "shape", "resource_id", "resource_offset", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: BufferRole
    dtype: DType
    shape: _containers.RepeatedCompositeFieldContainer[Dim]
    resource_id: str
    resource_offset: int
    rank: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[BufferRole, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[_Union[Dim, _Mapping]]] = ..., resource_id: _Optional[str] = ..., resource_offset: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class ModuleDecl(_message.Message):
    __slots__ = ("name", "target", "resource_id", "format")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    name: str
    target: str
    resource_id: str
    format: ModuleFormat
    def __init__(self, name: _Optional[str] = ..., target: _Optional[str] = ..., resource_id: _Optional[str] = ..., format: _Optional[_Union[ModuleFormat, str]] = ...) -> None: ...

class OpRef(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class BufferView(_message.Message):
    __slots__ = ("buffer", "element_offset", "shape")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    buffer: str
    element_offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, buffer: _Optional[str] = ..., element_offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorArg(_message.Message):
    __slots__ = ("name", "view")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    name: str
    view: BufferView
    def __init__(self, name: _Optional[str] = ..., view: _Optional[_Union[BufferView, _Mapping]] = ...) -> None: ...

class Attribute(_message.Message):
    __slots__ = ("name", "int_value", "float_value", "string_value", "ints", "floats")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    INTS_FIELD_NUMBER: _ClassVar[int]
    FLOATS_FIELD_NUMBER: _ClassVar[int]
    name: str
    int_value: int
    float_value: float
    string_value: str
    ints: IntList
    floats: FloatList
    def __init__(self, name: _Optional[str] = ..., int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., string_value: _Optional[str] = ..., ints: _Optional[_Union[IntList, _Mapping]] = ..., floats: _Optional[_Union[FloatList, _Mapping]] = ...) -> None: ...

class IntList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class FloatList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class LaunchParam(_message.Message):
    __slots__ = ("kind", "buffer", "byte_offset", "int_value", "float_value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: ParamKind
    buffer: str
    byte_offset: int
    int_value: int
    float_value: float
    def __init__(self, kind: _Optional[_Union[ParamKind, str]] = ..., buffer: _Optional[str] = ..., byte_offset: _Optional[int] = ..., int_value: _Optional[int] = ..., float_value: _Optional[float] = ...) -> None: ...

class KernelLaunch(_message.Message):
    __slots__ = ("target", "module", "symbol", "grid", "block", "shared_bytes", "params", "programmatic_wait")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    SYMBOL_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROGRAMMATIC_WAIT_FIELD_NUMBER: _ClassVar[int]
    target: str
    module: str
    symbol: str
    grid: _containers.RepeatedScalarFieldContainer[int]
    block: _containers.RepeatedScalarFieldContainer[int]
    shared_bytes: int
    params: _containers.RepeatedCompositeFieldContainer[LaunchParam]
    programmatic_wait: bool
    def __init__(self, target: _Optional[str] = ..., module: _Optional[str] = ..., symbol: _Optional[str] = ..., grid: _Optional[_Iterable[int]] = ..., block: _Optional[_Iterable[int]] = ..., shared_bytes: _Optional[int] = ..., params: _Optional[_Iterable[_Union[LaunchParam, _Mapping]]] = ..., programmatic_wait: _Optional[bool] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "op", "args", "attributes", "launches", "depends_on")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    DEPENDS_ON_FIELD_NUMBER: _ClassVar[int]
    name: str
    op: OpRef
    args: _containers.RepeatedCompositeFieldContainer[TensorArg]
    attributes: _containers.RepeatedCompositeFieldContainer[Attribute]
    launches: _containers.RepeatedCompositeFieldContainer[KernelLaunch]
    depends_on: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., op: _Optional[_Union[OpRef, _Mapping]] = ..., args: _Optional[_Iterable[_Union[TensorArg, _Mapping]]] = ..., attributes: _Optional[_Iterable[_Union[Attribute, _Mapping]]] = ..., launches: _Optional[_Iterable[_Union[KernelLaunch, _Mapping]]] = ..., depends_on: _Optional[_Iterable[str]] = ...) -> None: ...

class ProgramDecl(_message.Message):
    __slots__ = ("name", "operation", "nodes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    name: str
    operation: _contract_pb2.Operation
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, name: _Optional[str] = ..., operation: _Optional[_Union[_contract_pb2.Operation, str]] = ..., nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class TransportEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Transport(_message.Message):
    __slots__ = ("frames", "entries", "frame_index_entry", "submission_sequence_entry")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FRAME_INDEX_ENTRY_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_SEQUENCE_ENTRY_FIELD_NUMBER: _ClassVar[int]
    frames: int
    entries: _containers.RepeatedCompositeFieldContainer[TransportEntry]
    frame_index_entry: str
    submission_sequence_entry: str
    def __init__(self, frames: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[TransportEntry, _Mapping]]] = ..., frame_index_entry: _Optional[str] = ..., submission_sequence_entry: _Optional[str] = ...) -> None: ...

class CompletionRecord(_message.Message):
    __slots__ = ("field", "buffer")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    field: CompletionField
    buffer: str
    def __init__(self, field: _Optional[_Union[CompletionField, str]] = ..., buffer: _Optional[str] = ...) -> None: ...

class TuningProducer(_message.Message):
    __slots__ = ("program", "outputs")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    program: str
    outputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, program: _Optional[str] = ..., outputs: _Optional[_Iterable[str]] = ...) -> None: ...

class EngramTable(_message.Message):
    __slots__ = ("name", "buffer", "row_nbytes", "rows", "resource_id", "table_rows", "row_width", "dtype", "max_order", "heads_per_order", "primes", "multipliers", "pad_id", "compression_resource_id", "frames")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    ROW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    TABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_ORDER_FIELD_NUMBER: _ClassVar[int]
    HEADS_PER_ORDER_FIELD_NUMBER: _ClassVar[int]
    PRIMES_FIELD_NUMBER: _ClassVar[int]
    MULTIPLIERS_FIELD_NUMBER: _ClassVar[int]
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RESOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    name: str
    buffer: str
    row_nbytes: int
    rows: int
    resource_id: str
    table_rows: int
    row_width: int
    dtype: DType
    max_order: int
    heads_per_order: int
    primes: _containers.RepeatedScalarFieldContainer[int]
    multipliers: _containers.RepeatedScalarFieldContainer[int]
    pad_id: int
    compression_resource_id: str
    frames: int
    def __init__(self, name: _Optional[str] = ..., buffer: _Optional[str] = ..., row_nbytes: _Optional[int] = ..., rows: _Optional[int] = ..., resource_id: _Optional[str] = ..., table_rows: _Optional[int] = ..., row_width: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., max_order: _Optional[int] = ..., heads_per_order: _Optional[int] = ..., primes: _Optional[_Iterable[int]] = ..., multipliers: _Optional[_Iterable[int]] = ..., pad_id: _Optional[int] = ..., compression_resource_id: _Optional[str] = ..., frames: _Optional[int] = ...) -> None: ...

class ExecutionManifest(_message.Message):
    __slots__ = ("abi_label", "ranks", "op_catalogue", "buffers", "modules", "programs", "transport", "completion", "tuning_programs", "tuning", "targets", "engram_tables")
    ABI_LABEL_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    OP_CATALOGUE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    TUNING_PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    TUNING_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    ENGRAM_TABLES_FIELD_NUMBER: _ClassVar[int]
    abi_label: str
    ranks: int
    op_catalogue: int
    buffers: _containers.RepeatedCompositeFieldContainer[BufferDecl]
    modules: _containers.RepeatedCompositeFieldContainer[ModuleDecl]
    programs: _containers.RepeatedCompositeFieldContainer[ProgramDecl]
    transport: Transport
    completion: _containers.RepeatedCompositeFieldContainer[CompletionRecord]
    tuning_programs: _containers.RepeatedCompositeFieldContainer[ProgramDecl]
    tuning: _containers.RepeatedCompositeFieldContainer[TuningProducer]
    targets: _containers.RepeatedScalarFieldContainer[str]
    engram_tables: _containers.RepeatedCompositeFieldContainer[EngramTable]
    def __init__(self, abi_label: _Optional[str] = ..., ranks: _Optional[int] = ..., op_catalogue: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[BufferDecl, _Mapping]]] = ..., modules: _Optional[_Iterable[_Union[ModuleDecl, _Mapping]]] = ..., programs: _Optional[_Iterable[_Union[ProgramDecl, _Mapping]]] = ..., transport: _Optional[_Union[Transport, _Mapping]] = ..., completion: _Optional[_Iterable[_Union[CompletionRecord, _Mapping]]] = ..., tuning_programs: _Optional[_Iterable[_Union[ProgramDecl, _Mapping]]] = ..., tuning: _Optional[_Iterable[_Union[TuningProducer, _Mapping]]] = ..., targets: _Optional[_Iterable[str]] = ..., engram_tables: _Optional[_Iterable[_Union[EngramTable, _Mapping]]] = ...) -> None: ...
