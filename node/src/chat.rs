//! Text for people: tokenizers and chat formats. (Not implemented yet.)
