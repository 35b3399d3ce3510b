"""Structured outputs: constraining generated text to a JSON schema, regex, choice list or grammar.

`backend_types.py` is the interface a grammar library implements, `backend_guidance.py` its llguidance
implementation, `request.py` one sequence's constraint state, and `manager.py` the engine side: compiling grammars
off the engine thread (cached by their text) and computing each step's token bitmask."""
