"""The Qwen3 model Belayer serves and trains: config (``model.config``), weights
(``model.loader``), tokenizer and chat format (``model.tokenizer``, ``model.chat``), the paged-KV
forward (``model.qwen3``) and the dense training forward (``model.train_forward``).

The package itself imports nothing, so what needs only a config or a tokenizer (the CLI,
``belayer --help``) does not load torch: import from the submodule you use.
"""
