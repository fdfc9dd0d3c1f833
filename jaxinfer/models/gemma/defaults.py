"""What a Gemma GGUF's tokenizer leaves unsaid (plain data: no imports, so tools read it alone).

llama.cpp knows these by architecture rather than from the file, and many converted Gemma files
carry neither a chat template nor the end-of-turn id (the Gemma 3 270M GGUF has neither); the
family's FAMILY hands them to the loader, which passes them to the tokenizer:

  GEMMA_CHAT_TEMPLATE   the chat template where the file has none
  GEMMA_END_OF_TURN     a token that ends generation (beside <eos>), as Gemma's own
                        generation config lists it

The template renders `<start_of_turn>{role}\\n{content}<end_of_turn>\\n` per message, with the
assistant's role spelled "model", a system message folded into the first user turn (Gemma has no
system role) and `<start_of_turn>model\\n` as the generation prompt; it starts with the BOS token,
so a rendered prompt is encoded without adding another.
"""

from __future__ import annotations

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Gemma conversations alternate user and assistant turns, starting with user') }}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{%- if loop.first and system -%}{%- set text = system + '\\n\\n' + text -%}{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'"
    " + (text | trim) + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
GEMMA_END_OF_TURN = "<end_of_turn>"
