"""The model options a command line offers, named without importing torch: `kvreuse COMMAND --help` lists them,
and the CLI checks them before any model loads."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch's names of the dtypes a model may run in
# The weights a decoding step multiplies: the model's own (its dtype), or int8 copies (LayerwiseModel.decode_in_int8)
DECODE_WEIGHTS = ("model", "int8")
