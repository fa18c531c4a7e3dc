from helios_core.wire import contract_pb2 as _contract_pb2
from helios_core.wire import manifest_pb2 as _manifest_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SignatureAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SIGNATURE_ALGORITHM_UNSPECIFIED: _ClassVar[SignatureAlgorithm]
    SIGNATURE_ALGORITHM_ED25519: _ClassVar[SignatureAlgorithm]

class SignedLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SIGNED_LAYOUT_UNSPECIFIED: _ClassVar[SignedLayout]
    SIGNED_LAYOUT_PAYLOAD: _ClassVar[SignedLayout]
    SIGNED_LAYOUT_LOGICAL_V6: _ClassVar[SignedLayout]
    SIGNED_LAYOUT_LOGICAL_V4: _ClassVar[SignedLayout]

class ResourceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESOURCE_KIND_UNSPECIFIED: _ClassVar[ResourceKind]
    RESOURCE_KIND_WEIGHTS: _ClassVar[ResourceKind]
    RESOURCE_KIND_MODULE: _ClassVar[ResourceKind]
    RESOURCE_KIND_TOKENIZER: _ClassVar[ResourceKind]
    RESOURCE_KIND_CHAT_TEMPLATE: _ClassVar[ResourceKind]
    RESOURCE_KIND_STATE_INIT: _ClassVar[ResourceKind]
SIGNATURE_ALGORITHM_UNSPECIFIED: SignatureAlgorithm
SIGNATURE_ALGORITHM_ED25519: SignatureAlgorithm
SIGNED_LAYOUT_UNSPECIFIED: SignedLayout
SIGNED_LAYOUT_PAYLOAD: SignedLayout
SIGNED_LAYOUT_LOGICAL_V6: SignedLayout
SIGNED_LAYOUT_LOGICAL_V4: SignedLayout
RESOURCE_KIND_UNSPECIFIED: ResourceKind
RESOURCE_KIND_WEIGHTS: ResourceKind
RESOURCE_KIND_MODULE: ResourceKind
RESOURCE_KIND_TOKENIZER: ResourceKind
RESOURCE_KIND_CHAT_TEMPLATE: ResourceKind
RESOURCE_KIND_STATE_INIT: ResourceKind

class CoreBody(_message.Message):
    __slots__ = ("format_version", "payload", "protected_index", "locations")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    payload: SignedEnvelope
    protected_index: ProtectedIndex
    locations: LocationSet
    def __init__(self, format_version: _Optional[int] = ..., payload: _Optional[_Union[SignedEnvelope, _Mapping]] = ..., protected_index: _Optional[_Union[ProtectedIndex, _Mapping]] = ..., locations: _Optional[_Union[LocationSet, _Mapping]] = ...) -> None: ...

class Signature(_message.Message):
    __slots__ = ("key_id", "algorithm", "signature")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    algorithm: SignatureAlgorithm
    signature: bytes
    def __init__(self, key_id: _Optional[str] = ..., algorithm: _Optional[_Union[SignatureAlgorithm, str]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SignedEnvelope(_message.Message):
    __slots__ = ("signed_bytes", "signatures")
    SIGNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    signed_bytes: bytes
    signatures: _containers.RepeatedCompositeFieldContainer[Signature]
    def __init__(self, signed_bytes: _Optional[bytes] = ..., signatures: _Optional[_Iterable[_Union[Signature, _Mapping]]] = ...) -> None: ...

class DeploymentBody(_message.Message):
    __slots__ = ("publisher_namespace", "contract", "execution", "resources", "rebuild", "weight_catalogs", "description", "layout")
    PUBLISHER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    REBUILD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CATALOGS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    publisher_namespace: str
    contract: _contract_pb2.ServingContract
    execution: _manifest_pb2.ExecutionManifest
    resources: _containers.RepeatedCompositeFieldContainer[ExecutableResource]
    rebuild: RebuildManifest
    weight_catalogs: _containers.RepeatedCompositeFieldContainer[WeightCatalog]
    description: str
    layout: SignedLayout
    def __init__(self, publisher_namespace: _Optional[str] = ..., contract: _Optional[_Union[_contract_pb2.ServingContract, _Mapping]] = ..., execution: _Optional[_Union[_manifest_pb2.ExecutionManifest, _Mapping]] = ..., resources: _Optional[_Iterable[_Union[ExecutableResource, _Mapping]]] = ..., rebuild: _Optional[_Union[RebuildManifest, _Mapping]] = ..., weight_catalogs: _Optional[_Iterable[_Union[WeightCatalog, _Mapping]]] = ..., description: _Optional[str] = ..., layout: _Optional[_Union[SignedLayout, str]] = ...) -> None: ...

class ExecutableResource(_message.Message):
    __slots__ = ("id", "kind", "decoded_nbytes", "stored_nbytes", "chunk_nbytes", "chunk_sha256", "rank", "sealed")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DECODED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SHA256_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: ResourceKind
    decoded_nbytes: int
    stored_nbytes: int
    chunk_nbytes: int
    chunk_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    rank: int
    sealed: SealedChunks
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[_Union[ResourceKind, str]] = ..., decoded_nbytes: _Optional[int] = ..., stored_nbytes: _Optional[int] = ..., chunk_nbytes: _Optional[int] = ..., chunk_sha256: _Optional[_Iterable[bytes]] = ..., rank: _Optional[int] = ..., sealed: _Optional[_Union[SealedChunks, _Mapping]] = ...) -> None: ...

class SealedChunks(_message.Message):
    __slots__ = ("plain_chunk_nbytes", "nonce_prefix")
    PLAIN_CHUNK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    NONCE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    plain_chunk_nbytes: int
    nonce_prefix: bytes
    def __init__(self, plain_chunk_nbytes: _Optional[int] = ..., nonce_prefix: _Optional[bytes] = ...) -> None: ...

class LocationSet(_message.Message):
    __slots__ = ("locations",)
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[ResourceLocation]
    def __init__(self, locations: _Optional[_Iterable[_Union[ResourceLocation, _Mapping]]] = ...) -> None: ...

class ResourceLocation(_message.Message):
    __slots__ = ("resource_id", "file", "offset", "length")
    RESOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    resource_id: str
    file: str
    offset: int
    length: int
    def __init__(self, resource_id: _Optional[str] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ProtectedIndex(_message.Message):
    __slots__ = ("version", "index")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    version: int
    index: SignedEnvelope
    def __init__(self, version: _Optional[int] = ..., index: _Optional[_Union[SignedEnvelope, _Mapping]] = ...) -> None: ...

class ModelIndex(_message.Message):
    __slots__ = ("publisher_namespace", "contract", "execution", "resources", "rebuild", "weight_catalogs", "description", "layout")
    PUBLISHER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    REBUILD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CATALOGS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    publisher_namespace: str
    contract: _contract_pb2.ServingContract
    execution: _manifest_pb2.ExecutionManifest
    resources: _containers.RepeatedCompositeFieldContainer[ExecutableResource]
    rebuild: RebuildManifest
    weight_catalogs: _containers.RepeatedCompositeFieldContainer[WeightCatalog]
    description: str
    layout: SignedLayout
    def __init__(self, publisher_namespace: _Optional[str] = ..., contract: _Optional[_Union[_contract_pb2.ServingContract, _Mapping]] = ..., execution: _Optional[_Union[_manifest_pb2.ExecutionManifest, _Mapping]] = ..., resources: _Optional[_Iterable[_Union[ExecutableResource, _Mapping]]] = ..., rebuild: _Optional[_Union[RebuildManifest, _Mapping]] = ..., weight_catalogs: _Optional[_Iterable[_Union[WeightCatalog, _Mapping]]] = ..., description: _Optional[str] = ..., layout: _Optional[_Union[SignedLayout, str]] = ...) -> None: ...

class RebuildManifest(_message.Message):
    __slots__ = ("recipe", "toolkit_version", "inputs", "options")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    TOOLKIT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    recipe: str
    toolkit_version: str
    inputs: _containers.RepeatedCompositeFieldContainer[RebuildInput]
    options: _containers.ScalarMap[str, str]
    def __init__(self, recipe: _Optional[str] = ..., toolkit_version: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[RebuildInput, _Mapping]]] = ..., options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RebuildInput(_message.Message):
    __slots__ = ("name", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class WeightCatalog(_message.Message):
    __slots__ = ("version", "rank", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    rank: int
    tensors: _containers.RepeatedCompositeFieldContainer[CatalogTensor]
    def __init__(self, version: _Optional[int] = ..., rank: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[CatalogTensor, _Mapping]]] = ...) -> None: ...

class CatalogTensor(_message.Message):
    __slots__ = ("name", "resource_id", "byte_offset", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    resource_id: str
    byte_offset: int
    dtype: _manifest_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., resource_id: _Optional[str] = ..., byte_offset: _Optional[int] = ..., dtype: _Optional[_Union[_manifest_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...
