"""English text the random-weight models' tokenizer is trained on, and benchmark prompts' words.

Fixed text in the package (not a download) so that tokenizer is the same on every machine. Its
subject is the one this package is about, so prompts about memory, paging and language models
split into sensible tokens.
"""

CORPUS = """\
A language model writes text one token at a time. Each new token looks back at every token that
came before it, and the part of the model that does the looking is called attention. For every
token, every layer computes a key and a value. The keys and values of earlier tokens never
change, so an inference engine keeps them in memory instead of computing them again at every
step. This memory is the key-value cache, or KV cache for short, and on a busy server it is the
largest thing in memory after the weights themselves.

How big is it? Take a model with thirty-two layers, thirty-two heads and a head dimension of one
hundred and twenty-eight, stored in half precision. One token needs two tensors per layer, a key
and a value, each with four thousand and ninety-six numbers of two bytes. That is half a
megabyte for a single token. A request of two thousand tokens needs a full gigabyte. A graphics
card with eighty gigabytes of memory, after the weights are loaded, can only hold a few dozen
such requests at once.

The simple way to store the cache is to give every request one contiguous region, large enough
for the longest answer it might ever produce. Nobody knows in advance how long an answer will be.
A question about the weather may be answered in ten words; a request for a story may run to
thousands. If the engine reserves room for the maximum length, most of that room is never used.
Measurements of real systems found that sixty to eighty percent of the reserved memory was
wasted: reserved but empty, or lost between regions in small fragments that no request could use.

Operating systems met the same problem decades ago. Programs ask for memory, use some of it,
grow, shrink and finish at unpredictable times. The answer was paging. Physical memory is cut
into pages of a fixed size. A program sees a contiguous range of virtual addresses, and a page
table maps each virtual page to whatever physical page happens to be free. Pages are handed out
only when they are touched, so a program that reserves a large range but uses little of it costs
little. No page is ever too big or too small, so fragmentation between programs disappears.

PagedAttention applies the same idea to the KV cache. The cache is cut into blocks, and each block
holds the keys and values of a fixed number of tokens, for example sixteen. A request owns a block
table: a short list that maps its logical blocks, in order, to physical blocks anywhere in the
pool. When a request grows past the end of its last block, the engine takes one free block from
the pool and appends it to the table. When a request finishes, its blocks go back to the pool.
The only waste is the unused tail of each request's last block, which is less than one block.

The attention kernel must change a little. Instead of reading keys from one contiguous array, it
walks the block table: for the tokens of logical block zero it reads physical block seven, for
logical block one it reads physical block three, and so on. The arithmetic is the same; only the
addresses differ. Because every block has the same size, finding the address of any token is one
division and one lookup, and the kernel runs almost as fast as before.

Paging brings a second gift: sharing. Many requests begin with the same words. A chat service puts
the same system prompt in front of every conversation. A user who asks for several answers to one
question sends one prompt and receives many continuations. With a block table, two requests can
point at the same physical block. The block keeps a reference count, the number of tables that
point at it. Nothing is copied until one of the requests wants to write into a shared block; only
then does the engine copy that block and give the writer its own private version. This is called
copy on write, and it is exactly how an operating system makes a new process cheap to start.

Sharing can go further. If the engine remembers which blocks hold which tokens, a new request that
begins with text the engine has already seen can reuse those blocks and skip the work of computing
them. The engine hashes each full block together with the hash of the block before it, so that a
hash names not only sixteen tokens but the whole prefix that leads up to them. A table from hashes
to blocks then answers the question: have I computed this prefix before? Blocks that no running
request needs are not thrown away at once. They stay in a cache, and the least recently used ones
are evicted first when memory runs short.

The scheduler decides which requests run at each step. New requests wait in a queue. At every step
the scheduler admits waiting requests while there are free blocks for their prompts, and it keeps
running requests going while there is room for their next token. Requests that finish leave the
batch at once, and their places are filled at the very next step. This is continuous batching:
the batch is never a fixed group that must finish together, and a short answer never waits for a
long one. When memory runs out in the middle of a step, the scheduler must make room. It chooses a
victim, usually the request that arrived last, frees its blocks and puts it back in the queue. The
victim will compute its tokens again later. Recomputation sounds wasteful, but it is often cheaper
than copying the cache to the main memory of the computer and back.

A long prompt can be split into chunks. Instead of computing two thousand prompt tokens in one
step, while every other request waits for its next token, the engine computes a few hundred of
them per step, mixed with the single tokens of requests that are already generating. The steps
stay short, so streaming users see a steady flow of words.

Sampling turns the model's scores into the next token. Greedy decoding always takes the most
likely token. Temperature divides the scores before the softmax: a low temperature makes the
model confident and repetitive, a high temperature makes it adventurous and sometimes strange.
Top-k keeps only the k most likely tokens; top-p keeps the smallest set of tokens whose
probabilities add up to p. A seed makes the random choices repeatable, so that the same request
with the same seed gives the same answer.

The tokenizer sits at both ends. Before the model sees anything, the tokenizer cuts the text into
pieces from a fixed vocabulary and turns each piece into a number. Common words become one token;
rare words are spelled out of smaller pieces. Byte-level tokenizers can write any text at all,
because in the worst case they fall back to single bytes. After the model answers, the tokenizer
turns the numbers back into text. When words arrive one at a time, as they do in a streaming
answer, the decoder must be careful: a single character outside the basic Latin alphabet, an
accented letter or a symbol, may be split across two tokens, and half a character cannot be shown.

Here is a small story to read while the cache fills. Once upon a time there was a librarian who
kept a very large library with very small shelves. Every visitor wanted a shelf for the books they
might borrow, and at first the librarian gave each visitor a whole row, in case they wanted many
books. Soon the rows ran out, although most of them stood empty. So the librarian tried something
new. She cut every row into short shelves of sixteen books and kept a card for each visitor with
the numbers of their shelves. Visitors who borrowed more books got another shelf, wherever one was
free. Two friends who wanted the same books shared the same shelves, and only when one of them
wrote in a book did the librarian make a copy. The library now served many more visitors with the
same walls, and nobody noticed that their shelves were scattered all over the building.

The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore. How much wood
would a woodchuck chuck if a woodchuck could chuck wood? Peter Piper picked a peck of pickled
peppers. A journey of a thousand miles begins with a single step. All that glitters is not gold.
Practice makes perfect. Time and tide wait for no one. Actions speak louder than words. The early
bird catches the worm. Where there is a will, there is a way. Knowledge is power. Better late than
never. Every cloud has a silver lining. Rome was not built in a day.

Numbers and code appear in prompts too: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048
4096 8192; 3.14159, 2.71828, 1e-4, 0.5, 100%, $20, #1, x = y + 1, f(x) = x * x, a[i] = b[j],
if (n > 0) { return n - 1; } else { return 0; }, def generate(prompt, max_tokens=64):, import
torch, print("hello, world"), for i in range(10):, while True: break, {"role": "user"},
<tag attr="value">text</tag>, https://example.com/path?query=1, user@example.com.

Questions and answers make up much of what people ask a chat model. What is the capital of France?
The capital of France is Paris. Who wrote the play about the prince of Denmark? William
Shakespeare wrote Hamlet. Why is the sky blue? Sunlight scatters off the molecules of the air, and
blue light scatters the most. How many days are there in a week? There are seven days in a week:
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. The months of the year are
January, February, March, April, May, June, July, August, September, October, November and
December. Spring, summer, autumn and winter are the four seasons. Water boils at one hundred
degrees Celsius at sea level and freezes at zero. The earth goes around the sun once a year, and
the moon goes around the earth about once a month.

A short history of computing memory. Early machines stored numbers in mercury delay lines and on
rotating magnetic drums. Core memory followed: tiny rings of ferrite threaded on wires, each ring
holding one bit, woven by hand into planes. Semiconductor chips replaced the cores, and dynamic
memory, which must be refreshed thousands of times each second, became cheap enough to fill
desktops, laptops, telephones and data centres. Graphics processors brought their own fast memory,
stacked beside the processor in towers of silicon, with bandwidth measured in terabytes per second.
Yet capacity always lags behind ambition: whatever the hardware offers, software finds a way to
want more, and clever bookkeeping becomes worth as much as new transistors.

Travellers' notes from a journey through the mountains. We left the village before sunrise,
following a narrow path between pine trees and granite boulders. By noon the valley lay far below
us, quiet and green, with a river shining like a silver thread. Eagles circled overhead. In the
afternoon clouds gathered, thunder rolled across the peaks, and we sheltered in a wooden hut with
a stove, a kettle, and a shelf of old books left by earlier climbers. Someone had written in the
visitors' journal: patience is the mountaineer's most useful equipment. The storm passed quickly.
At dusk the sky turned orange, purple, and finally deep blue, and a thousand stars appeared.

In the kitchen: chop two onions, three cloves of garlic, and a handful of fresh parsley. Warm olive
oil in a heavy pan, soften the onions slowly, then add tomatoes, salt, pepper, a pinch of sugar,
and simmer for twenty minutes. Meanwhile boil pasta in generous salted water until it is tender
but still firm. Combine everything, sprinkle grated cheese, and serve immediately with bread,
salad, lemonade, or sparkling water. Leftovers keep overnight in the refrigerator.

Scientists describe nature with careful measurement. Physicists study energy, momentum, gravity,
electricity, magnetism, light, atoms and galaxies. Chemists combine elements such as hydrogen,
oxygen, carbon, nitrogen, sodium and chlorine into molecules. Biologists examine cells, genes,
proteins, enzymes, bacteria, plants, animals and ecosystems. Mathematicians prove theorems about
integers, fractions, matrices, vectors, probability, geometry, topology and infinity. Engineers
build bridges, engines, satellites, networks, compilers, databases and robots that must work
reliably, efficiently and safely, even when conditions are unexpected.

Musicians rehearse scales, chords, rhythms and melodies; painters mix colours such as crimson,
violet, turquoise, amber, ochre and emerald; gardeners plant roses, tulips, daffodils, lavender,
sunflowers, carrots, potatoes, cabbages, strawberries and apples. Children play football, chess,
hide and seek, and invent elaborate games with cardboard boxes. Grandparents tell stories about
winters so cold that the lake froze solid and everyone skated across it to the neighbouring town.

Hello! How can I help you today? Please explain this in simple words. Thank you very much. You are
a helpful assistant. Write a short poem about the sea. Summarize the following text. Translate this
sentence into French. Give me three ideas for dinner. Tell me a joke about computers. Why did the
computer go to the doctor? Because it had a virus. What did the cache say to the request? Sorry,
you missed. I think, therefore I am. To be or not to be, that is the question.
"""
