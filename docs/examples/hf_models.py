"""Hugging Face models built from their configs (random init, nothing downloaded), as model specs for
`torchspeed lint` (docs/doctor.md, "Transformers"):

    torchspeed lint docs/examples/hf_models.py:gpt2
    torchspeed lint docs/examples/hf_models.py:gpt2 --model-kwargs '{"attn_implementation": "eager"}'
    torchspeed lint docs/examples/hf_models.py:bert --input-shape 8,128

Each factory takes its config's fields as keywords (`--model-kwargs`); the defaults are the published
sizes of GPT-2 small (50,257-token vocabulary, 12 layers of width 768) and BERT base.
"""
import transformers


def gpt2(**config):
    """GPT2LMHeadModel of GPT-2 small's config (its head tied to the token embedding)."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))


def bert(**config):
    """BertModel of BERT base's config (no head: the encoder and its pooler)."""
    return transformers.BertModel(transformers.BertConfig(**config))
