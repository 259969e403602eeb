//! The built-in corpus: deterministic English-like documents from a small grammar, generated from
//! (seed, document index) alone, so it needs no download, is identical on every machine, and any
//! document can be produced directly (exact resume). A small model visibly learns its words,
//! sentence shapes and counting runs within a few hundred steps.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SUBJECTS: &[&str] = &[
    "the cat",
    "the dog",
    "a little bird",
    "the old man",
    "my friend",
    "the teacher",
    "a child",
    "the farmer",
    "the queen",
    "a sailor",
];
const VERBS: &[&str] = &[
    "sees",
    "likes",
    "finds",
    "follows",
    "helps",
    "draws",
    "carries",
    "watches",
    "paints",
    "remembers",
];
const OBJECTS: &[&str] = &[
    "the red ball",
    "a small house",
    "the green tree",
    "the river",
    "an apple",
    "the big ship",
    "a yellow flower",
    "the blue sky",
    "the old book",
    "a warm bread",
];
const ENDINGS: &[&str] = &[
    "today",
    "at night",
    "in the garden",
    "every morning",
    "near the sea",
    "with joy",
    "after school",
    "in the rain",
];
const NUMBERS: &[&str] = &[
    "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
    "twelve",
];

/// Document `index` of the corpus seeded by `seed`.
pub fn synthetic_document(seed: u64, index: u64) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ index);
    let mut doc = String::new();
    let sentences = rng.gen_range(3..8);
    for s in 0..sentences {
        if s > 0 {
            doc.push(' ');
        }
        if rng.gen_bool(0.2) {
            let start = rng.gen_range(0..NUMBERS.len() - 4);
            let len = rng.gen_range(3..=NUMBERS.len() - start);
            doc.push_str("we count ");
            doc.push_str(&NUMBERS[start..start + len].join(" "));
            doc.push('.');
        } else {
            let pick = |rng: &mut ChaCha8Rng, words: &[&str]| {
                words[rng.gen_range(0..words.len())].to_string()
            };
            let subject = pick(&mut rng, SUBJECTS);
            let mut sentence = format!(
                "{subject} {} {} {}.",
                pick(&mut rng, VERBS),
                pick(&mut rng, OBJECTS),
                pick(&mut rng, ENDINGS)
            );
            if s == 0 {
                sentence[..1].make_ascii_uppercase();
            }
            doc.push_str(&sentence);
        }
    }
    doc
}

#[cfg(test)]
mod tests {
    #[test]
    fn deterministic_and_varied() {
        assert_eq!(
            super::synthetic_document(1, 5),
            super::synthetic_document(1, 5)
        );
        assert_ne!(
            super::synthetic_document(1, 5),
            super::synthetic_document(1, 6)
        );
        assert_ne!(
            super::synthetic_document(1, 5),
            super::synthetic_document(2, 5)
        );
    }
}
