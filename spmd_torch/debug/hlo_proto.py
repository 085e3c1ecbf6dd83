"""XLA's ``HloModuleProto`` read in Python: its text and JSON forms, as PyTorch/XLA prints them.

jaxlib hands out a program's HLO module as serialized bytes only (``XlaComputation
.as_serialized_hlo_module_proto``); the schema that names its fields lives in XLA's C++ build, not
in any Python package. ``SCHEMA`` restates the part of ``xla/service/hlo.proto`` and
``xla/xla_data.proto`` that describes modules, computations, instructions, shapes, layouts,
shardings, literals and metadata (field numbers and types as XLA declares them), and protobuf
builds the message classes from it. Fields it leaves out still parse: the text form prints them
by number, the JSON form (which has no syntax for them) leaves them out.

Example:
    >>> module = hlo_proto.parse(xla_computation.as_serialized_hlo_module_proto())
    >>> 'opcode: "add"' in hlo_proto.to_text(module)
    True
"""

from __future__ import annotations

import functools

# message -> its fields, one per line: number, name, type ('*' before the name: repeated). A
# type is a protobuf scalar, an enum of ENUMS or a message of SCHEMA; nested messages of XLA's
# files are top-level here under their own names (their names never appear in either form).
SCHEMA = {
    "HloModuleProto": """
        1 name string
        2 entry_computation_name string
        6 entry_computation_id int64
        3 *computations HloComputationProto
        4 host_program_shape ProgramShapeProto
        5 id int64
        8 input_output_alias HloInputOutputAliasProto
        11 is_dynamic bool
        12 spmd_output_sharding OpSharding
        14 *spmd_parameters_shardings OpSharding
        16 use_auto_spmd_partitioning bool
        17 stack_frame_index StackFrameIndexProto
        18 buffer_donor HloBufferDonorProto
        19 frontend_attributes FrontendAttributes
    """,
    "HloComputationProto": """
        1 name string
        2 *instructions HloInstructionProto
        4 program_shape ProgramShapeProto
        5 id int64
        6 root_id int64
        7 is_fusion_computation bool
        8 execution_thread string
    """,
    "HloInstructionProto": """
        1 name string
        2 opcode string
        3 shape ShapeProto
        7 metadata OpMetadata
        8 literal LiteralProto
        9 parameter_number int64
        11 fusion_kind string
        13 tuple_index int64
        14 *dimensions int64
        15 window Window
        16 convolution_dimension_numbers ConvolutionDimensionNumbers
        50 feature_group_count int64
        58 batch_group_count int64
        17 *slice_dimensions SliceDimensions
        18 exponent_bits int32
        19 mantissa_bits int32
        20 *dynamic_slice_sizes int64
        21 padding_config PaddingConfig
        24 epsilon float
        25 feature_index int64
        26 channel_id int64
        28 custom_call_target string
        30 dot_dimension_numbers DotDimensionNumbers
        32 *fft_length int64
        63 comparison_direction string
        33 gather_dimension_numbers GatherDimensionNumbers
        34 *gather_slice_sizes int64
        35 id int64
        36 *operand_ids int64
        37 *control_predecessor_ids int64
        38 *called_computation_ids int64
        40 sharding OpSharding
        43 backend_config bytes
        49 *replica_groups ReplicaGroup
        71 use_global_device_ids bool
        60 is_stable bool
        48 scatter_dimension_numbers ScatterDimensionNumbers
        52 *source_target_pairs SourceTarget
        65 custom_call_has_side_effect bool
        67 indices_are_sorted bool
        69 unique_indices bool
        72 comparison_type string
        81 k int64
        85 largest bool
        68 frontend_attributes FrontendAttributes
        82 statistics_viz StatisticsViz
        87 collective_device_list CollectiveDeviceListProto
        89 is_composite bool
    """,
    "ShapeProto": """
        2 element_type PrimitiveType
        3 *dimensions int64
        6 *is_dynamic_dimension bool
        4 *tuple_shapes ShapeProto
        5 layout LayoutProto
    """,
    "LayoutProto": """
        1 *minor_to_major int64
        6 *tiles TileProto
        16 tail_padding_alignment_in_elements int64
        7 element_size_in_bits int64
        8 memory_space int64
    """,
    "TileProto": "1 *dimensions int64",
    "ProgramShapeProto": """
        1 *parameters ShapeProto
        2 result ShapeProto
        3 *parameter_names string
    """,
    "OpMetadata": """
        1 op_type string
        2 op_name string
        3 source_file string
        4 source_line int32
        17 source_end_line int32
        18 source_column int32
        19 source_end_column int32
        12 deduplicated_name string
        15 stack_frame_id int32
        16 scheduling_name string
    """,
    "OpSharding": """
        1 type OpSharding.Type
        2 tile_shape ShapeProto
        3 *tile_assignment_dimensions int64
        4 *tile_assignment_devices int64
        5 *tuple_shardings OpSharding
        6 replicate_on_last_tile_dim bool
        7 *metadata OpMetadata
        8 *last_tile_dims OpSharding.Type
        9 *iota_reshape_dims int64
        10 *iota_transpose_perm int32
        11 is_shard_group bool
        12 shard_group_id int64
    """,
    "LiteralProto": """
        1 shape ShapeProto
        2 *preds bool
        15 s8s bytes
        3 u8s bytes
        4 *s32s int32
        5 *s64s int64
        6 *u32s uint32
        7 *u64s uint64
        8 *f32s float
        9 *f64s double
        12 *c64s float
        18 *c128s double
        10 *tuple_literals LiteralProto
        11 f16s bytes
        13 bf16s bytes
        16 u16s bytes
        17 s16s bytes
    """,
    "Window": "1 *dimensions WindowDimension",
    "WindowDimension": """
        1 size int64
        2 stride int64
        3 padding_low int64
        4 padding_high int64
        5 window_dilation int64
        6 base_dilation int64
        7 window_reversal bool
    """,
    "ConvolutionDimensionNumbers": """
        7 input_batch_dimension int64
        8 input_feature_dimension int64
        11 *input_spatial_dimensions int64
        3 kernel_input_feature_dimension int64
        4 kernel_output_feature_dimension int64
        6 *kernel_spatial_dimensions int64
        9 output_batch_dimension int64
        10 output_feature_dimension int64
        12 *output_spatial_dimensions int64
    """,
    "DotDimensionNumbers": """
        1 *lhs_contracting_dimensions int64
        2 *rhs_contracting_dimensions int64
        3 *lhs_batch_dimensions int64
        4 *rhs_batch_dimensions int64
    """,
    "GatherDimensionNumbers": """
        1 *offset_dims int64
        2 *collapsed_slice_dims int64
        3 *start_index_map int64
        4 index_vector_dim int64
        5 *operand_batching_dims int64
        6 *start_indices_batching_dims int64
    """,
    "ScatterDimensionNumbers": """
        1 *update_window_dims int64
        2 *inserted_window_dims int64
        3 *scatter_dims_to_operand_dims int64
        4 index_vector_dim int64
        5 *input_batching_dims int64
        6 *scatter_indices_batching_dims int64
    """,
    "SliceDimensions": """
        1 start int64
        2 limit int64
        3 stride int64
    """,
    "PaddingConfig": "1 *dimensions PaddingConfigDimension",
    "PaddingConfigDimension": """
        1 edge_padding_low int64
        2 edge_padding_high int64
        3 interior_padding int64
    """,
    "FrontendAttributes": "1 *map FrontendAttribute",  # XLA's map<string, string>, entry by entry
    "FrontendAttribute": """
        1 key string
        2 value string
    """,
    "StatisticsViz": """
        1 stat_index_to_visualize int64
        2 *statistics Statistic
    """,
    "Statistic": """
        1 stat_name string
        2 stat_val double
    """,
    "ReplicaGroup": "1 *replica_ids int64",
    "SourceTarget": """
        1 source int64
        2 target int64
    """,
    "CollectiveDeviceListProto": """
        1 *replica_groups ReplicaGroup
        2 iota_replica_group_list IotaReplicaGroupListProto
    """,
    "IotaReplicaGroupListProto": """
        1 num_replica_groups int64
        2 num_devices_per_group int64
        3 *iota_reshape_dims int64
        4 *iota_transpose_perm int32
    """,
    "HloInputOutputAliasProto": "1 *entries AliasEntryProto",
    "AliasEntryProto": """
        1 *output_shape_index int64
        2 parameter_number int64
        3 *parameter_shape_index int64
        4 kind AliasEntryProto.Kind
    """,
    "HloBufferDonorProto": "1 *entries BufferDonorEntryProto",
    "BufferDonorEntryProto": """
        1 parameter_number int64
        2 *parameter_shape_index int64
    """,
    "StackFrameIndexProto": """
        1 *file_names string
        2 *function_names string
        3 *file_locations FileLocation
        4 *stack_frames StackFrame
    """,
    "FileLocation": """
        1 file_name_id int32
        2 function_name_id int32
        3 line int32
        4 column int32
    """,
    "StackFrame": """
        1 file_location_id int32
        2 parent_frame_id int32
    """,
}

# enum -> its values (name number ...), as XLA numbers them; ``Message.Enum`` is nested in its
# message, as in XLA's files (value names are scoped by what holds the enum).
ENUMS = {
    "PrimitiveType": """
        PRIMITIVE_TYPE_INVALID 0 PRED 1 S1 30 S2 26 S4 21 S8 2 S16 3 S32 4 S64 5 U1 31 U2 27
        U4 22 U8 6 U16 7 U32 8 U64 9 F16 10 F32 11 BF16 16 F64 12 F8E5M2 19 F8E4M3 28
        F8E4M3FN 20 F8E4M3B11FNUZ 23 F8E3M4 29 F8E5M2FNUZ 24 F8E4M3FNUZ 25 F4E2M1FN 32
        F8E8M0FNU 33 C64 15 C128 18 TUPLE 13 OPAQUE_TYPE 14 TOKEN 17 BUFFER 34
    """,
    "OpSharding.Type": "REPLICATED 0 MAXIMAL 1 TUPLE 2 OTHER 3 MANUAL 4 UNKNOWN 5 UNREDUCED 6",
    "AliasEntryProto.Kind": "UNDEFINED_ALIAS 0 MAY_ALIAS 1 MUST_ALIAS 2",
}


def parse(serialized: bytes):
    """A serialized ``HloModuleProto`` as a protobuf message."""
    module = _classes()["HloModuleProto"]()
    module.ParseFromString(serialized)
    return module


def to_text(message) -> str:
    """Protobuf's text form (``opcode: "parameter"``), fields outside ``SCHEMA`` by number."""
    from google.protobuf import text_format

    return text_format.MessageToString(message, print_unknown_fields=True)


def to_json(message) -> str:
    """Protobuf's JSON form, field names in lowerCamelCase (``hostProgramShape``)."""
    from google.protobuf import json_format

    return json_format.MessageToJson(message)


@functools.cache
def _classes() -> dict:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    scalars = {
        name: getattr(F, f"TYPE_{name.upper()}")
        for name in ("string", "bytes", "bool", "int32", "int64", "uint32", "uint64")
        + ("float", "double")
    }
    file = descriptor_pb2.FileDescriptorProto(
        name="spmd_torch/hlo_subset.proto", package="spmd_torch.xla", syntax="proto3"
    )
    messages = {name: file.message_type.add(name=name) for name in SCHEMA}
    for name, values in ENUMS.items():
        holder, _, enum_name = name.rpartition(".")
        enum = (messages[holder] if holder else file).enum_type.add(name=enum_name)
        words = values.split()
        for value, number in zip(words[::2], words[1::2]):
            enum.value.add(name=value, number=int(number))
    for name, fields in SCHEMA.items():
        for line in fields.strip().splitlines():
            number, field, kind = line.split()
            entry = messages[name].field.add(
                name=field.lstrip("*"),
                number=int(number),
                label=F.LABEL_REPEATED if field.startswith("*") else F.LABEL_OPTIONAL,
            )
            if kind in scalars:
                entry.type = scalars[kind]
            else:
                entry.type = F.TYPE_ENUM if kind in ENUMS else F.TYPE_MESSAGE
                entry.type_name = f".spmd_torch.xla.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"spmd_torch.xla.{name}"))
        for name in SCHEMA
    }
