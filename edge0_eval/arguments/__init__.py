"""What the verbs' command lines share: argparse `type=` checks (value_types) and the engine's
flags mapped onto one `EngineOptions` (engine_flags)."""
