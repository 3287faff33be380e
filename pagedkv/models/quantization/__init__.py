"""Quantized weights, whatever their source, as GGUF blocks.

Every quantized weight the loader meets becomes one
:class:`~pagedkv.models.quantization.blocks.QuantizedWeight`:
raw GGUF blocks, their ggml type and the ``(out, in)`` shape of the matrix they hold. Two sources
make them: a quantized Hugging Face checkpoint (GPTQ, AWQ, compressed-tensors ``pack-quantized``;
:mod:`.hf_scheme` reads and checks its ``quantization_config``, :mod:`.hf_unpack` unpacks its
integers, :mod:`.hf_groups` gathers each layer's tensors) and on-the-fly quantization of a 16/32-bit
checkpoint (:mod:`.on_the_fly`, with llama.cpp's Q4_K quantizer in :mod:`.k_quants`).
:func:`.install.install_quantized` puts a weight into the model.
"""
