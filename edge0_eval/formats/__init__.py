"""What is on disk, one module per file format: each reads its files into plain tensors and typed
metadata, checks them (one error naming the file, the field and the fix) and writes them. Nothing
here imports the engine; the engine builds its objects (the model, LoRA layers, prerouter heads)
from what these modules return.

    json_files      strict JSON files (config.json, experts.index.json, adapter_config.json, ...)
    safetensors     the safetensors header check and the atomic writer every writer uses
    layout          experts.bin + experts.index.json: the streaming layout's expert bundles
    config          config.json (against mlx-lm's ModelArgs) and generation_config.json
    model_dir       a converted model directory: resident weights, tokenizer, the files together
    adapters        LoRA adapter files: this project's (read, check, write), PEFT's and mlx-lm
                    tuner's (read into this project's layout)
    heads_file      prerouter heads files and their `PrerouterConfig`
    draft_file      draft vocabulary files (the draft-token hedge's token ids)
    jsonl           JSON-lines input files (prompts, training text): one object per line
"""
