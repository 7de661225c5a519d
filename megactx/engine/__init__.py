"""The inference engine. Until it lands, `LLM` refuses clearly instead of pretending to work."""

from megactx.engine.sampling_params import SamplingParams


class LLM:
    """The paged-KV inference engine (continuous batching, MTP speculative decoding).

    Not implemented yet: it arrives with the engine issue. For now use `megactx.load_model(path)`
    and call the model for reference logits."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "megactx.LLM (the inference engine) is not implemented yet; for reference logits use "
            "megactx.load_model(path)(input_ids)"
        )


__all__ = ["LLM", "SamplingParams"]
