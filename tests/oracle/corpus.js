// Deterministic test strings for tokenizer conformance: many scripts, emoji, code, whitespace
// runs, digits, special-token strings and very long words, mixed at random with a fixed seed.
'use strict';

function rng(seed) {
  // mulberry32: small, fast and reproducible across Node versions.
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const fragments = {
  english: [
    'The quick brown fox jumps over the lazy dog.', "It's a test; they're here, we've gone, I'm sure you'll see.",
    "DON'T SHOUT! WE'LL LISTEN.", 'Hello, world!', 'e-mail: someone@example.com', 'https://example.org/a/b?c=d&e=f#g',
    'Mr. Smith paid $1,234.56 for 3.5kg (approx.) — really?', '"Quoted" and \'single\' and `backticks`',
    'state-of-the-art', 'naïve café résumé', 'co-operate; re-enter: pre-empt…', 'A.B.C. D/E F\\G',
  ],
  chinese: ['你好，世界！', '我们今天去北京大学参加会议。', '机器学习和深度学习的区别是什么？', '《红楼梦》是中国古典小说。', '价格：１２３元'],
  japanese: ['こんにちは、世界！', 'カタカナとひらがなと漢字を混ぜた文章です。', '東京都渋谷区で会いましょう。', 'ｶﾀｶﾅ半角テスト'],
  korean: ['안녕하세요, 세계!', '대한민국의 수도는 서울입니다.', '한국어 형태소 분석기', '\u1100\u1161\u11A8 (jamo)'],
  arabic: ['مرحبا بالعالم', 'اللغة العربية جميلة جداً.', '٠١٢٣٤٥٦٧٨٩ أرقام', 'שלום עולם'],
  other: ['Привет, мир! Как дела?', 'Γειά σου Κόσμε', 'नमस्ते दुनिया', 'สวัสดีชาวโลก', 'Xin chào thế giới', 'Ünïcödé Çåfé ß ẞ İ ı'],
  emoji: ['😀', '👨‍👩‍👧‍👦', '👍🏽', '🇺🇸🇯🇵', '🏳️‍🌈', '❤️', '🧑🏿‍💻', '✨🚀🔥', '👩‍❤️‍💋‍👨', '1️⃣'],
  code: [
    'int main() {\n    return 0;\n}\n', 'def f(x):\n\tif x > 0:\n\t\treturn x ** 2\n\treturn -x\n',
    '{"key": [1, 2, 3], "nested": {"a": null}}', 'for (auto& [k, v] : map) { std::cout << k << v; }',
    'SELECT * FROM users WHERE id = 42;', '#include <vector>\n// comment\n/* block */', '    x = y  +  z    # spaces',
    'a_b_c __init__ self.__dict__', '<div class="x">&amp;</div>', 'λx.x → ∀y∃z', '$HOME/.config ~/bin && ls -la | grep "foo"',
  ],
  space: [' ', '  ', '\n', '\n\n', '\n\n\n\n', '\r\n', '\t', '\t\t  \n', ' \n ', '\u00a0', '\u3000', '\u2028', '\u0085', '\u2003\u2009',
    '      \n', '\n   \n\t'],
  digits: ['0', '7', '42', '123', '1234', '12345678901234567890', '3.14159', '-0.5e-10', '1,000,000', '２０２４年', '٣٤٥', '½ ⅓ ²³', '0x1F', '192.168.1.1'],
  // Characters assigned in Unicode 15.0: emoji, CJK Extension H, Kawi, Nag Mundari, Kaktovik
  // numerals, new marks. PCRE2 10.42 carries Unicode 14 and would miss them; Tandem's regexes take
  // their classes from ICU (15.0). Nothing from 15.1 or later: ICU 72 does not know it. Nothing
  // with a compatibility decomposition either (U+1E030 ... are NFKC-mapped by ICU 15.0, not by the
  // older tables of HF's normalizers).
  unicode15: ['love 🩷', '🩵🩶', 'wow 🫨!', 'a 🪿 b', '🛜 wifi', '🫎🫏🪼🪽', '🪮🪇🪈🫚🫛', '\u{31350}\u{31351}\u{323AF}',
    ' \u{11F04}\u{11F05}\u{11F34}\u{11F12}', '\u{1E4D0}\u{1E4D1}\u{1E4EC}\u{1E4F0}', '\u{1D2C0}\u{1D2C1}\u{1D2D3}',
    '\u0C95\u0CF3', '\u0E81\u0ECE', 'x\u{11F43}\u{11B00}y', '\u{1F774}\u{1F7D9}'],
  combining: ['e\u0301', 'a\u0308o\u0308', '\u0041\u030A', 'Å', '\u1100\u1161', 'ﬁ ﬂ', 'Ω Ω', '\u0915\u094D\u0937', 'n\u0303'],
};

function randomWord(r, len) {
  const letters = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ';
  let w = '';
  for (let i = 0; i < len; i++) w += letters[Math.floor(r() * letters.length)];
  return w;
}

// Code points from long-assigned blocks only: HF's Oniguruma (Unicode 16.0) is newer than the ICU
// (15.0) whose classes Tandem uses, and characters of 15.1 or later would test that gap, not the
// tokenizer. The unicode15 fragments cover the characters that are new in 15.0.
const blocks = [[0x20, 0x7e], [0xa0, 0x24f], [0x370, 0x3ff], [0x400, 0x4ff], [0x590, 0x5ff], [0x600, 0x6ff],
  [0x900, 0x97f], [0xe00, 0xe7f], [0x2000, 0x206f], [0x20a0, 0x20bf], [0x2190, 0x21ff], [0x2200, 0x22ff],
  [0x3000, 0x303f], [0x3040, 0x30ff], [0x4e00, 0x9fa5], [0xac00, 0xd7a3], [0xff00, 0xffef], [0x1f300, 0x1f64f]];

function randomUnicode(r, len) {
  let s = '';
  for (let i = 0; i < len; i++) {
    const [lo, hi] = blocks[Math.floor(r() * blocks.length)];
    s += String.fromCodePoint(lo + Math.floor(r() * (hi - lo + 1)));
  }
  return s;
}

function makeCorpus(count, specialTokens, seed = 20261129) {
  const r = rng(seed);
  const pick = (arr) => arr[Math.floor(r() * arr.length)];
  const kinds = Object.keys(fragments);
  const out = [];
  // Fixed edge cases first.
  out.push('', ' ', 'a', '\n', 'a'.repeat(5000), ' '.repeat(3000), '\n'.repeat(500), 'ab'.repeat(2000) + '!',
    randomWord(r, 4000), '9'.repeat(1001), '😀'.repeat(300), '你'.repeat(1000), ' \t'.repeat(800) + 'x',
    ...fragments.unicode15);
  for (const t of specialTokens.slice(0, 40)) out.push(t, 'x' + t + 'y', ' ' + t + ' ', t + t, t.slice(0, -1));
  while (out.length < count) {
    const n = 1 + Math.floor(r() * 8);
    let s = '';
    for (let i = 0; i < n; i++) {
      const p = r();
      if (p < 0.62) s += pick(fragments[pick(kinds)]);
      else if (p < 0.72) s += pick(specialTokens);
      else if (p < 0.82) s += randomWord(r, 1 + Math.floor(r() * (r() < 0.1 ? 300 : 12)));
      else if (p < 0.92) s += randomUnicode(r, 1 + Math.floor(r() * 20));
      else s += pick(fragments.space).repeat(1 + Math.floor(r() * 6));
      if (r() < 0.5) s += pick([' ', '', '\n', ', ', '. ', '  ']);
    }
    out.push(s);
  }
  return out;
}

module.exports = { makeCorpus, rng };
