"""The OpenCompass models: `edge0_model.py` the student on the Edge0 engine, `mlx_lm_model.py`
the teacher on mlx-lm, `edge0_api_model.py` either one served over an OpenAI-compatible API,
and `chat.py` the plumbing they share (prompts, chat template, stop words, sampling options,
per-sample stats), so that every arm is prompted and sampled alike.
"""
