"""The prompt topics shared by the demo builder and router training.

One list of everyday subjects, filled into each user's own question templates: the demo
builder (``demo/small.py``) splits it into training and held-out topics for distilling the
small model, and router training (``routing/training/data.py``) fills it into its templates
to get varied prompts for the large model to answer. The order and spelling are part of the
demo's recipe (the held-out split takes every 5th topic), so a change here rebuilds the
demo pair: append rather than edit.
"""

from __future__ import annotations

TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "volcanoes",
    "the immune system", "climate change", "the Roman Empire", "quantum computing",
    "honey bees", "the stock market", "electric cars", "the water cycle", "Shakespeare",
    "the internet", "vaccines", "the Moon landing", "coffee", "chess", "jazz music",
    "the human heart", "earthquakes", "renewable energy", "the printing press", "dinosaurs",
    "sleep", "recycling", "the Great Wall of China", "gravity", "democracy", "bread baking",
    "the Olympic Games", "plate tectonics", "DNA", "social media", "ancient Egypt",
    "rainforests", "blockchain", "meditation", "the solar system", "volunteering",
    "public libraries", "inflation", "origami", "the Amazon river", "video games",
    "nuclear energy", "the piano", "time management", "coral reefs", "the Renaissance",
    "artificial intelligence", "marathon running", "tea", "the moon", "penguins",
    "public speaking", "gardening", "the Industrial Revolution", "smartphones", "electricity",
    "the ocean tides", "mountain climbing", "photography", "the Cold War", "antibiotics",
    "bicycles", "rain", "friendship", "budgeting", "the Eiffel Tower", "wolves", "Mars",
    "poetry", "the Silk Road", "email", "chocolate", "hurricanes", "learning a new language",
    "cloud computing", "the brain", "yoga", "the desert", "electric guitars", "trains",
    "the Mona Lisa", "pizza", "cryptography", "glaciers", "the Vikings", "robots", "soccer",
    "the periodic table", "camping", "opera", "the Pyramids", "magnets", "whales", "rice",
    "3D printing", "octopuses", "the Titanic", "solar panels", "the Beatles", "knitting",
    "tornadoes", "the Great Barrier Reef", "submarines", "the Statue of Liberty",
    "cheese making", "sourdough", "the Wright brothers", "hot air balloons", "lighthouses",
    "fireworks", "the Aurora Borealis", "kangaroos", "bamboo", "the Sahara", "sushi",
    "haunted houses", "skateboarding", "crossword puzzles", "the violin", "ballet",
    "street art", "comic books", "board games", "podcasts", "electric scooters",
    "wind turbines", "composting", "beekeeping", "bird migration", "butterflies", "mushrooms",
    "cacti", "tulips", "owls", "elephants", "dolphins", "sharks", "ants", "spiders", "frogs",
    "lions", "giraffes", "horses", "cats", "dogs", "hamsters", "parrots", "snow", "fog",
    "lightning", "rainbows", "the seasons", "the equator", "the Arctic", "Antarctica",
    "the Himalayas", "the Alps", "Iceland", "Japan", "Brazil", "Kenya", "Canada", "Australia",
    "India", "Mexico", "Egypt's Nile", "Venice", "New York City", "Paris", "London", "Tokyo",
    "the Grand Canyon", "Yellowstone", "the Dead Sea", "Mount Everest", "caves", "islands",
    "lakes", "waterfalls", "bridges", "skyscrapers", "castles", "windmills", "canals",
    "airports", "hospitals", "schools", "museums", "zoos", "farms", "factories", "restaurants",
    "supermarkets", "banks", "post offices", "fire stations", "police work", "nursing",
    "teaching", "engineering", "architecture", "law", "journalism", "accounting", "plumbing",
    "carpentry", "firefighting", "astronauts", "pilots", "chefs", "doctors", "scientists",
    "farmers", "musicians", "painters", "writers", "the novel", "fairy tales", "mythology",
    "Greek gods", "Norse myths", "King Arthur", "Sherlock Holmes", "detective stories",
    "science fiction", "superheroes", "cartoons", "animation", "movies", "theater", "circus",
    "magic tricks", "puppets", "knots", "maps", "compasses", "clocks", "calendars",
    "the alphabet", "numbers", "fractions", "geometry", "algebra", "probability", "statistics",
    "prime numbers", "infinity", "logic puzzles", "spreadsheets", "databases",
    "Python programming", "web browsers", "passwords", "computer viruses", "operating systems",
    "keyboards", "batteries", "lasers", "microscopes", "telescopes", "satellites", "rockets",
    "the Hubble telescope", "comets", "meteors", "the Sun", "stars", "galaxies", "the Big Bang",
    "atoms", "molecules", "acids and bases", "salt", "water", "oxygen", "carbon", "iron",
    "gold", "diamonds", "plastic", "glass", "paper", "cotton", "wool", "silk", "leather",
    "rubber", "concrete", "steel",
)  # fmt: skip
