import datetime

from google.longrunning import operations_pb2 as _operations_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.rpc import error_details_pb2 as _error_details_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[State]
    QUEUED: _ClassVar[State]
    RUNNING: _ClassVar[State]
    SUCCEEDED: _ClassVar[State]
    FAILED: _ClassVar[State]
    CANCELLED: _ClassVar[State]
STATE_UNSPECIFIED: State
QUEUED: State
RUNNING: State
SUCCEEDED: State
FAILED: State
CANCELLED: State

class CompressRequest(_message.Message):
    __slots__ = ("model", "target_speedup", "uniform_ratio", "widths_from", "calibration", "eval", "shape", "execution_provider", "method", "accuracy_budget", "back_off", "time_budget", "labels", "request_id", "options", "no_accuracy_budget")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_RATIO_FIELD_NUMBER: _ClassVar[int]
    WIDTHS_FROM_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BACK_OFF_FIELD_NUMBER: _ClassVar[int]
    TIME_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NO_ACCURACY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    model: str
    target_speedup: float
    uniform_ratio: float
    widths_from: str
    calibration: str
    eval: str
    shape: Shape
    execution_provider: str
    method: str
    accuracy_budget: float
    back_off: bool
    time_budget: _duration_pb2.Duration
    labels: _containers.ScalarMap[str, str]
    request_id: str
    options: CompressOptions
    no_accuracy_budget: bool
    def __init__(self, model: _Optional[str] = ..., target_speedup: _Optional[float] = ..., uniform_ratio: _Optional[float] = ..., widths_from: _Optional[str] = ..., calibration: _Optional[str] = ..., eval: _Optional[str] = ..., shape: _Optional[_Union[Shape, _Mapping]] = ..., execution_provider: _Optional[str] = ..., method: _Optional[str] = ..., accuracy_budget: _Optional[float] = ..., back_off: _Optional[bool] = ..., time_budget: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., request_id: _Optional[str] = ..., options: _Optional[_Union[CompressOptions, _Mapping]] = ..., no_accuracy_budget: _Optional[bool] = ...) -> None: ...

class Shape(_message.Message):
    __slots__ = ("batch", "sequence")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    batch: int
    sequence: int
    def __init__(self, batch: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class CompressOptions(_message.Message):
    __slots__ = ("samples", "seed", "mean", "std", "batch_size", "sequences", "sequence_length", "stream", "activation_dtype", "threads", "deployment_target", "round_to", "min_width", "max_rounds", "repeats", "opset", "precision", "decode_step", "no_curves_cache", "gqa", "refine_steps", "latency_probes", "min_sequence_length", "remove_blocks", "add_bias")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_DTYPE_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_TARGET_FIELD_NUMBER: _ClassVar[int]
    ROUND_TO_FIELD_NUMBER: _ClassVar[int]
    MIN_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    OPSET_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_FIELD_NUMBER: _ClassVar[int]
    NO_CURVES_CACHE_FIELD_NUMBER: _ClassVar[int]
    GQA_FIELD_NUMBER: _ClassVar[int]
    REFINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_PROBES_FIELD_NUMBER: _ClassVar[int]
    MIN_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REMOVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADD_BIAS_FIELD_NUMBER: _ClassVar[int]
    samples: int
    seed: int
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    batch_size: int
    sequences: int
    sequence_length: int
    stream: bool
    activation_dtype: str
    threads: int
    deployment_target: str
    round_to: int
    min_width: float
    max_rounds: int
    repeats: int
    opset: int
    precision: str
    decode_step: bool
    no_curves_cache: bool
    gqa: str
    refine_steps: int
    latency_probes: int
    min_sequence_length: int
    remove_blocks: int
    add_bias: str
    def __init__(self, samples: _Optional[int] = ..., seed: _Optional[int] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ..., batch_size: _Optional[int] = ..., sequences: _Optional[int] = ..., sequence_length: _Optional[int] = ..., stream: _Optional[bool] = ..., activation_dtype: _Optional[str] = ..., threads: _Optional[int] = ..., deployment_target: _Optional[str] = ..., round_to: _Optional[int] = ..., min_width: _Optional[float] = ..., max_rounds: _Optional[int] = ..., repeats: _Optional[int] = ..., opset: _Optional[int] = ..., precision: _Optional[str] = ..., decode_step: _Optional[bool] = ..., no_curves_cache: _Optional[bool] = ..., gqa: _Optional[str] = ..., refine_steps: _Optional[int] = ..., latency_probes: _Optional[int] = ..., min_sequence_length: _Optional[int] = ..., remove_blocks: _Optional[int] = ..., add_bias: _Optional[str] = ...) -> None: ...

class CompressMetadata(_message.Message):
    __slots__ = ("state", "stage", "round", "layer", "layers", "message", "attempt", "create_time", "start_time", "end_time", "labels", "artifacts", "request", "report")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    state: State
    stage: str
    round: int
    layer: int
    layers: int
    message: str
    attempt: int
    create_time: _timestamp_pb2.Timestamp
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    labels: _containers.ScalarMap[str, str]
    artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    request: CompressRequest
    report: _struct_pb2.Struct
    def __init__(self, state: _Optional[_Union[State, str]] = ..., stage: _Optional[str] = ..., round: _Optional[int] = ..., layer: _Optional[int] = ..., layers: _Optional[int] = ..., message: _Optional[str] = ..., attempt: _Optional[int] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ..., request: _Optional[_Union[CompressRequest, _Mapping]] = ..., report: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class CompressResponse(_message.Message):
    __slots__ = ("report", "artifacts")
    REPORT_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    report: CompressReport
    artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    def __init__(self, report: _Optional[_Union[CompressReport, _Mapping]] = ..., artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ...) -> None: ...

class CompressReport(_message.Message):
    __slots__ = ("status", "target_speedup", "uniform_ratio", "measured_speedup", "baseline_latency_ms", "compressed_latency_ms", "execution_provider", "device", "metric", "params_before", "params_after", "method", "layers", "elapsed_s", "full")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_RATIO_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    BASELINE_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    PARAMS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_AFTER_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    status: str
    target_speedup: float
    uniform_ratio: float
    measured_speedup: float
    baseline_latency_ms: float
    compressed_latency_ms: float
    execution_provider: str
    device: str
    metric: Metric
    params_before: int
    params_after: int
    method: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerResult]
    elapsed_s: float
    full: _struct_pb2.Struct
    def __init__(self, status: _Optional[str] = ..., target_speedup: _Optional[float] = ..., uniform_ratio: _Optional[float] = ..., measured_speedup: _Optional[float] = ..., baseline_latency_ms: _Optional[float] = ..., compressed_latency_ms: _Optional[float] = ..., execution_provider: _Optional[str] = ..., device: _Optional[str] = ..., metric: _Optional[_Union[Metric, _Mapping]] = ..., params_before: _Optional[int] = ..., params_after: _Optional[int] = ..., method: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerResult, _Mapping]]] = ..., elapsed_s: _Optional[float] = ..., full: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class Metric(_message.Message):
    __slots__ = ("name", "baseline", "compressed", "relative_drop")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_DROP_FIELD_NUMBER: _ClassVar[int]
    name: str
    baseline: float
    compressed: float
    relative_drop: float
    def __init__(self, name: _Optional[str] = ..., baseline: _Optional[float] = ..., compressed: _Optional[float] = ..., relative_drop: _Optional[float] = ...) -> None: ...

class LayerResult(_message.Message):
    __slots__ = ("name", "kind", "width_before", "width_after", "objective", "relative_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WIDTH_BEFORE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_AFTER_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    width_before: int
    width_after: int
    objective: float
    relative_error: float
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., width_before: _Optional[int] = ..., width_after: _Optional[int] = ..., objective: _Optional[float] = ..., relative_error: _Optional[float] = ...) -> None: ...

class Artifact(_message.Message):
    __slots__ = ("name", "sha256", "size_bytes", "media_type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    size_bytes: int
    media_type: str
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., media_type: _Optional[str] = ...) -> None: ...

class WatchCompressionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CompressionEvent(_message.Message):
    __slots__ = ("name", "state", "stage", "round", "layer", "layers", "message", "time", "operation")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: State
    stage: str
    round: int
    layer: int
    layers: int
    message: str
    time: _timestamp_pb2.Timestamp
    operation: _operations_pb2.Operation
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[State, str]] = ..., stage: _Optional[str] = ..., round: _Optional[int] = ..., layer: _Optional[int] = ..., layers: _Optional[int] = ..., message: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., operation: _Optional[_Union[_operations_pb2.Operation, _Mapping]] = ...) -> None: ...

class UploadBlobRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: BlobHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[BlobHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class BlobHeader(_message.Message):
    __slots__ = ("filename", "archive", "size_bytes", "sha256")
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    filename: str
    archive: bool
    size_bytes: int
    sha256: str
    def __init__(self, filename: _Optional[str] = ..., archive: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class Blob(_message.Message):
    __slots__ = ("reference", "sha256", "size_bytes")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    reference: str
    sha256: str
    size_bytes: int
    def __init__(self, reference: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class DownloadArtifactRequest(_message.Message):
    __slots__ = ("name", "artifact", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    artifact: str
    offset: int
    def __init__(self, name: _Optional[str] = ..., artifact: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ArtifactChunk(_message.Message):
    __slots__ = ("data", "offset", "artifact")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    artifact: Artifact
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., artifact: _Optional[_Union[Artifact, _Mapping]] = ...) -> None: ...
