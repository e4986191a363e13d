"""The front end: the `Engine` API (`engine.py`) and process launch and supervision
(`launcher.py`), composed from the tokenizer side's pieces (`tokenizer_proc`)."""
