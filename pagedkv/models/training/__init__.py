"""Training the built-in model: a tiny Llama that learns the Python standard library's source.

``python -m pagedkv.models.training --out DIR`` trains a byte-level BPE and the model on CPU
in minutes and writes a Hugging Face folder; the trained folder ships in the package as
:func:`pagedkv.models.builtin_model_path`. :mod:`.stdlib_text` chooses the training and
held-out files and is importable without torch or transformers, so perplexity code elsewhere
measures on exactly the held-out text; :mod:`.train` needs ``transformers`` (the ``train``
extra).
"""
