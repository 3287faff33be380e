"""Structured output: constrain what a request generates to a JSON schema, a regex, a choice or a grammar.

- :mod:`~pagedkv.engine.structured.params` -- ``StructuredOutputsParams``, what a request asks for;
- :mod:`~pagedkv.engine.structured.config` -- ``StructuredOutputsConfig``, the deployer's limits;
- :mod:`~pagedkv.engine.structured.compiler` -- ``GrammarCompiler``: compiles off the engine
  thread, cached by spec, within the limits;
- :mod:`~pagedkv.engine.structured.manager` -- ``StructuredOutputManager``: the engine's one
  compiler, and a fresh matcher for each constrained request;
- :mod:`~pagedkv.engine.structured.xgrammar_backend` -- the grammar library (xgrammar), and how
  JSON is spaced;
- :mod:`~pagedkv.engine.structured.ebnf` -- reading a grammar's printed rules: can any output
  complete it, llama.cpp's GBNF spellings, splicing whitespace rules;
- :mod:`~pagedkv.engine.structured.schema_support` -- the JSON schema keywords the grammar
  cannot enforce, refused by name;
- :mod:`~pagedkv.engine.structured.matcher` -- ``GrammarMatcher``, one sequence's grammar state;
- :mod:`~pagedkv.engine.structured.bitmask` -- token bitmasks and their application to logits
  (the only module here that uses torch).

Only ``StructuredOutputsParams`` is exported from the package: it must stay importable from
``SamplingParams`` without pulling in the compiler (which imports the engine's validation).
"""

from pagedkv.engine.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
