"""Meta's checkpoint format: params.json + consolidated.NN.pth (+ tokenizer.model). (In progress.)"""

from torchllama.errors import ModelFileError


def read_meta(path, dtype, progress=True):
    """(args, state dict, tokenizer) of a Meta checkpoint folder."""
    raise ModelFileError(f"{path}: Meta checkpoints are not supported yet")
