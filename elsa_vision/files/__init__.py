"""Files from outside and the files the package writes, one module per job:

* :mod:`.checkpoints`: weights and checkpoint files read without executing anything (``read_checkpoint``,
  ``read_weights``, ``unwrap_weights``, ``strip_prefixes`` ...);
* :mod:`.torchscript`: the TorchScript reader, the tensors of a ``torch.jit.save`` archive without running it;
* :mod:`.limits`: what an input may make the process allocate or open, checked before it is read (declared
  sizes, regular files, checkpoint records and tensors), and the small readers that apply the limits
  (``open_image``, ``read_npy``);
* :mod:`.arguments`: the ``--max-input-gib`` and ``--out`` / ``--overwrite`` arguments of the command-line
  tools;
* :mod:`.outputs`: output directories checked before a run, and atomic writes.

Every name is importable from ``elsa_vision.files`` itself.
"""

from .arguments import add_max_input_argument, add_output_arguments
from .checkpoints import (
    STATE_DICT_KEYS,
    NotACheckpointError,
    UnsafeCheckpointError,
    checkpoint_kind,
    read_checkpoint,
    read_safetensors_metadata,
    read_weights,
    strip_prefixes,
    submodule_weights,
    unwrap_weights,
)
from .limits import (
    DEFAULT_MAX_ARRAY_BYTES,
    FileTooLargeError,
    check_array_bytes,
    check_image_pixels,
    check_npy_holds,
    check_regular_file,
    npy_header,
    open_image,
    read_npy,
)
from .outputs import (
    OUTPUT_MANIFEST,
    atomic_torch_save,
    atomic_write,
    link_atomically,
    prepare_output_dir,
    record_outputs,
    remove_outputs,
    remove_stale_temp_files,
    save_safetensors,
)
from .torchscript import read_torchscript_state_dict

__all__ = [
    "DEFAULT_MAX_ARRAY_BYTES",
    "FileTooLargeError",
    "NotACheckpointError",
    "OUTPUT_MANIFEST",
    "STATE_DICT_KEYS",
    "UnsafeCheckpointError",
    "atomic_torch_save",
    "atomic_write",
    "add_max_input_argument",
    "add_output_arguments",
    "check_array_bytes",
    "check_image_pixels",
    "check_npy_holds",
    "check_regular_file",
    "checkpoint_kind",
    "link_atomically",
    "npy_header",
    "open_image",
    "prepare_output_dir",
    "read_checkpoint",
    "read_npy",
    "read_safetensors_metadata",
    "read_torchscript_state_dict",
    "read_weights",
    "record_outputs",
    "remove_outputs",
    "remove_stale_temp_files",
    "save_safetensors",
    "strip_prefixes",
    "submodule_weights",
    "unwrap_weights",
]
