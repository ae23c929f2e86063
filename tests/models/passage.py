"""A fixed English passage (written for these tests) for teacher-forced quality checks: about 1,100 tokens."""

PASSAGE = """\
The old lighthouse stood at the end of a narrow spit of land, where the river met the sea. For more than a
hundred years its keepers climbed the spiral stairs each evening to light the lamp, polish the great lens and
write the weather in a leather book. The last keeper, a quiet woman named Elsie, kept the book for thirty-one
years. She wrote down the wind, the height of the waves, the ships that passed and, now and then, a line about
the birds that rested on the rail: a heron in March, a flock of geese in October, once an owl that stayed for
three nights and then vanished.

When the lamp was finally automated, the town held a small ceremony. The mayor gave a speech, children sang,
and Elsie was given a clock that she never wound. She moved into a cottage near the harbour and spent her
mornings at the market, where she sold honey from the hives she kept behind the house. People said her honey
tasted of heather and salt. She said it tasted of patience.

Bread is one of the oldest foods people make. Flour and water are mixed into a dough, and yeast, a tiny
fungus, feeds on the sugars in the flour. As it feeds it gives off carbon dioxide, and the gas is trapped in a
web of gluten, the stretchy protein that forms when the dough is kneaded. The dough rises, is shaped, rises
again and goes into a hot oven. There the water turns to steam, the gas expands, the yeast dies and the crust
browns as sugars and proteins react. A good loaf has a crisp crust, an open crumb and a smell that fills the
whole kitchen.

The sky is blue because of the way sunlight is scattered by the air. Sunlight holds every colour, but the
molecules of nitrogen and oxygen scatter short wavelengths much more strongly than long ones. Blue light is
bounced around the sky and reaches our eyes from every direction, while red and yellow light pass more
directly. At sunset the light travels through much more air, most of the blue is scattered away before it
reaches us, and the sky glows orange and red.

Owls are birds of prey that hunt mostly at night. Their eyes are large and face forward, which gives them good
depth perception, but they cannot move their eyes in their sockets, so they turn their heads instead, up to
about three quarters of a full circle. Their feathers have soft, fringed edges that break up the flow of air,
which lets them fly almost without a sound. Many owls can find a mouse under snow by hearing alone, because
their ears are set at slightly different heights on their heads.

A train journey across the mountains begins in the dark. The station is cold, the platform lights hum, and a
few passengers wait with their coats buttoned to the chin. When the train pulls out, the city falls away and
the first grey light shows fields, then forests, then the long climb into the hills. The track follows a
river through a deep valley, crosses it on a stone bridge and enters a tunnel so long that the carriage lamps
come on. On the far side there is snow on the peaks, and the sun lights them pink before it reaches the
valley floor. By noon the train has crossed the pass and starts the slow descent toward the sea.

To multiply twelve by twelve, one can split the problem into easier parts. Twelve times ten is one hundred
and twenty, and twelve times two is twenty-four. Adding the two gives one hundred and forty-four. The same
trick works for many numbers: break one of them into tens and ones, multiply each part and add the results.
Children who learn it early often find that mental arithmetic becomes a game rather than a chore.

The capital of France is Paris, a city on the river Seine. It is known for its museums, its cafes, its wide
boulevards and its bridges. The Louvre holds some of the most famous paintings in the world, and the Eiffel
Tower, built for a world fair in 1889, was once meant to stand for only twenty years. Today millions of
visitors climb it each year to look out over the roofs, the parks and the river winding through the city.

In the evening Elsie would sometimes walk back to the lighthouse. She did not go inside. She sat on the low
wall, watched the beam turn over the water and counted the seconds between its flashes, as she had done every
night for thirty-one years. The count was always the same. She found that comforting, and she said so to
anyone who asked why she still came.
"""
