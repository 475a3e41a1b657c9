"""A few paragraphs to train the tiny test tokenizer on: English prose, code, numbers, and some multi-byte text
so that merges split characters across tokens, as the real tokenizer's do."""

SAMPLE_TEXT = """\
The river ran slowly past the old mill, and the miller's daughter counted the boats as they went by. There
were twelve in the morning and nine in the afternoon; the last one carried apples, and the smell of them
stayed on the water long after the boat had gone round the bend.

A language model reads text as a sequence of tokens. Each token is a small piece of a word, a whole word,
or a run of spaces. The model predicts the next token, the engine samples it, and the detokenizer turns the
growing list of tokens back into text that a person can read, one character at a time.

In the workshop, the clock on the wall said a quarter past four. "We should finish the table before dinner,"
said the carpenter, brushing sawdust from his sleeves. His apprentice nodded, measured the leg again, and
marked the wood with a pencil: 42 centimetres, not 41. Small errors grow when you stack them.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

Weather report: on Monday, 18 degrees and light rain; on Tuesday, 21 degrees and sunny; on Wednesday, strong
wind from the west, up to 60 km/h. Remember your umbrella, your coat, and your good humour.

Café, naïve, résumé, jalapeño, Straße, smørrebrød. 日本語のテキストも少し入れておきます。今日は良い天気です。
中文也有一点：你好，世界！我们今天学习分词。 Emoji too: 🙂 🚀 🌍 👍🏽 — and a few symbols: € £ ¥ © ™ ✓.

Questions and answers. What is a token? A unit of text. Why split words? So that rare words still have a
representation. How long is a sentence? As long as it needs to be, and no longer. Where does the story end?
Where the reader stops reading, or where the writer runs out of paper, whichever comes first.
"""
