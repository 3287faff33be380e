"""Training the built-in model: a tiny Llama that learns the Python standard library's source.

``python -m pagedkv.models.builtin.train --out DIR`` trains a byte-level BPE and the model on CPU
and writes a Hugging Face folder; the shipped folder
(:func:`pagedkv.models.builtin.builtin_model_path`) was made by it with the defaults.
:mod:`.stdlib_text` chooses the training and held-out files and :mod:`.windows` cuts them into
token windows; both import without transformers, so perplexity code elsewhere measures on
exactly the held-out text. :mod:`.recipe` (the recipe and the training loop) needs
``transformers`` (the ``train`` extra).
"""
