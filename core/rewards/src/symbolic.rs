//! The part of `sympy` that verl's prm800k graders use: `parse_expr(expr.replace("^", "**"),
//! transformations=standard_transformations + (implicit_multiplication_application,))` and
//! `simplify(diff) == 0`.
//!
//! Parsing follows Python's tokenizer and sympy's transformations: `2x`, `2(x+1)`, `(a)(b)`,
//! `2 3` and `pi x` are products; a name that is not sympy's (`xy`, `sqrt2`) splits into
//! one-letter symbols and digit runs; `sqrt`/`ln` apply to a following parenthesis or token;
//! `5!` is a factorial; `042` tokenizes as `0` `42` (a product, 0). Whatever Python or sympy
//! reject — tuples, lists, relations, keywords, characters outside Python's expression syntax,
//! and the names this port does not model — is "not equal", as verl's `except` makes it.
//!
//! Equality: sympy decides `simplify(a - b) == 0` symbolically. Here the difference is
//! evaluated in complex arithmetic (sympy's principal branches) with every symbol at several
//! fixed points and counts as zero when it vanishes at all of them to 1e-9 relative to the
//! terms — once with the true values and once with every root conjugated and π moved (see
//! [`Pass`]), which keeps a Float that approximates an irrational from cancelling it, as sympy
//! keeps them apart. For the answers graders meet — numbers, fractions, radicals, π,
//! polynomials and rational functions in one or two letters — this is what simplify decides.
//! It can still differ where simplify fails to prove a true identity, or where two exact values
//! agree to 9 digits and are not equal; the parity test lists such cases.

/// A complex number, enough for principal-branch powers and roots.
#[derive(Debug, Clone, Copy, PartialEq)]
struct C {
    re: f64,
    im: f64,
}

impl C {
    const fn real(re: f64) -> Self {
        C { re, im: 0.0 }
    }
    fn add(self, o: C) -> C {
        C {
            re: self.re + o.re,
            im: self.im + o.im,
        }
    }
    fn sub(self, o: C) -> C {
        C {
            re: self.re - o.re,
            im: self.im - o.im,
        }
    }
    fn mul(self, o: C) -> C {
        C {
            re: self.re * o.re - self.im * o.im,
            im: self.re * o.im + self.im * o.re,
        }
    }
    fn div(self, o: C) -> C {
        let d = o.re * o.re + o.im * o.im;
        C {
            re: (self.re * o.re + self.im * o.im) / d,
            im: (self.im * o.re - self.re * o.im) / d,
        }
    }
    fn abs(self) -> f64 {
        self.re.hypot(self.im)
    }
    fn ln(self) -> C {
        C {
            re: self.abs().ln(),
            im: self.im.atan2(self.re),
        }
    }
    fn exp(self) -> C {
        let m = self.re.exp();
        C {
            re: m * self.im.cos(),
            im: m * self.im.sin(),
        }
    }
    fn pow(self, e: C) -> C {
        if e.im == 0.0 && e.re.fract() == 0.0 && e.re.abs() <= 64.0 {
            // Integer powers by multiplication: exact where sympy's are.
            let mut acc = C::real(1.0);
            for _ in 0..e.re.abs() as u32 {
                acc = acc.mul(self);
            }
            return if e.re < 0.0 {
                C::real(1.0).div(acc)
            } else {
                acc
            };
        }
        if self.re == 0.0 && self.im == 0.0 {
            return if e.re > 0.0 {
                C::real(0.0)
            } else {
                C::real(f64::NAN)
            };
        }
        if self.im == 0.0 && self.re > 0.0 && e.im == 0.0 {
            return C::real(self.re.powf(e.re));
        }
        self.ln().mul(e).exp()
    }
    fn sqrt(self) -> C {
        if self.im == 0.0 && self.re >= 0.0 {
            return C::real(self.re.sqrt());
        }
        self.pow(C::real(0.5))
    }
    fn finite(self) -> bool {
        self.re.is_finite() && self.im.is_finite()
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    /// The value, and whether Python wrote it as an integer.
    Num(f64, bool),
    Name(String),
    Op(&'static str),
}

/// Python's tokens for `s`; None on a character Python's tokenizer rejects or a number form
/// (hex, imaginary, …) this port does not model.
fn tokenize(s: &str) -> Option<Vec<Tok>> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let digits = |i: &mut usize| {
        // [0-9](?:_?[0-9])*
        let start = *i;
        while *i < chars.len() {
            let digit = chars[*i].is_ascii_digit();
            let joiner = chars[*i] == '_'
                && *i > start
                && chars.get(*i + 1).is_some_and(char::is_ascii_digit);
            if !(digit || joiner) {
                break;
            }
            *i += 1;
        }
        *i > start
    };
    while i < chars.len() {
        let c = chars[i];
        if c == ' ' || c == '\t' || c == '\x0c' {
            i += 1;
            continue;
        }
        if c.is_ascii_digit() || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)) {
            let start = i;
            let mut float = false;
            digits(&mut i);
            if chars.get(i) == Some(&'.') {
                float = true;
                i += 1;
                digits(&mut i);
            }
            if matches!(chars.get(i), Some('e' | 'E')) {
                let save = i;
                i += 1;
                if matches!(chars.get(i), Some('+' | '-')) {
                    i += 1;
                }
                if digits(&mut i) {
                    float = true;
                } else {
                    i = save;
                }
            }
            let text: String = chars[start..i].iter().filter(|&&c| c != '_').collect();
            if !float && text.len() > 1 && text.starts_with('0') {
                // Python's Decnumber is `0(?:_?0)*|[1-9]…`: "042" is the tokens 0 and 42.
                let zeros = text.chars().take_while(|&c| c == '0').count();
                i = start;
                let mut seen = 0;
                while seen < zeros {
                    if chars[i] == '0' {
                        seen += 1;
                    }
                    i += 1;
                }
                out.push(Tok::Num(0.0, true));
                continue;
            }
            if matches!(
                chars.get(i),
                Some('j' | 'J' | 'x' | 'X' | 'o' | 'O' | 'b' | 'B')
            ) && text == "0"
            {
                return None;
            }
            if matches!(chars.get(i), Some('j' | 'J')) {
                return None;
            }
            out.push(Tok::Num(text.parse().ok()?, !float));
            continue;
        }
        if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Tok::Name(chars[start..i].iter().collect()));
            continue;
        }
        let two: String = chars[i..(i + 2).min(chars.len())].iter().collect();
        let op = match two.as_str() {
            "**" => Some("**"),
            "//" => Some("//"),
            _ => None,
        };
        if let Some(op) = op {
            out.push(Tok::Op(op));
            i += 2;
            continue;
        }
        out.push(Tok::Op(match c {
            '+' => "+",
            '-' => "-",
            '*' => "*",
            '/' => "/",
            '(' => "(",
            ')' => ")",
            '!' => "!",
            // Tuples, lists, sets, relations, attribute access, strings … are never a
            // number sympy can subtract.
            _ => return None,
        }));
        i += 1;
    }
    Some(out)
}

/// Names sympy knows (after `from sympy import *`) that an answer can reach: functions, and
/// constants that are not split into letters.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Known {
    Sqrt,
    Ln,
    Pi,
    Infinity,
    Nan,
    /// Another sympy name (`re`, `im`, `li`, `ff`, …): not modelled.
    Other,
}

fn known(name: &str) -> Option<Known> {
    Some(match name {
        "sqrt" => Known::Sqrt,
        "ln" | "log" => Known::Ln,
        "pi" => Known::Pi,
        "oo" | "zoo" => Known::Infinity,
        "nan" => Known::Nan,
        "E" | "I" | "N" | "O" | "Q" | "S" | "re" | "im" | "li" | "ff" | "rf" | "fu" | "jn"
        | "yn" | "csc" | "eye" | "fft" | "gff" | "ntt" | "exp" | "sin" | "cos" | "tan" | "abs"
        | "Abs" => Known::Other,
        _ => return None,
    })
}

const KEYWORDS: [&str; 8] = ["as", "if", "in", "is", "or", "and", "not", "del"];

/// Atoms after sympy's `split_symbols` and `auto_number`.
#[derive(Debug, Clone, PartialEq)]
enum Atom {
    Num(f64, bool),
    Sym(String),
    Fun(Known),
    Const(Known),
    Op(&'static str),
}

impl Atom {
    fn ends_operand(&self) -> bool {
        matches!(
            self,
            Atom::Num(..) | Atom::Sym(_) | Atom::Const(_) | Atom::Op(")")
        )
    }
    fn starts_operand(&self) -> bool {
        matches!(
            self,
            Atom::Num(..) | Atom::Sym(_) | Atom::Const(_) | Atom::Fun(_) | Atom::Op("(")
        )
    }
}

fn atoms(tokens: Vec<Tok>) -> Option<Vec<Atom>> {
    let mut out = Vec::new();
    for tok in tokens {
        match tok {
            Tok::Num(v, exact) => out.push(Atom::Num(v, exact)),
            Tok::Op(op) => out.push(Atom::Op(op)),
            Tok::Name(name) => {
                if KEYWORDS.contains(&name.as_str()) {
                    return None;
                }
                match known(&name) {
                    Some(Known::Other) => return None,
                    Some(f @ (Known::Sqrt | Known::Ln)) => out.push(Atom::Fun(f)),
                    Some(c) => out.push(Atom::Const(c)),
                    None if name.contains('_') || name.chars().count() == 1 || is_greek(&name) => {
                        out.push(Atom::Sym(name))
                    }
                    None => {
                        // split_symbols: letters become symbols, digit runs numbers.
                        let chars: Vec<char> = name.chars().collect();
                        let mut i = 0;
                        while i < chars.len() {
                            if chars[i].is_ascii_digit() {
                                let start = i;
                                while i < chars.len() && chars[i].is_ascii_digit() {
                                    i += 1;
                                }
                                let run: String = chars[start..i].iter().collect();
                                out.push(Atom::Num(run.parse().ok()?, true));
                            } else {
                                let c = chars[i].to_string();
                                if known(&c).is_some() {
                                    return None;
                                }
                                out.push(Atom::Sym(c));
                                i += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    // implicit_multiplication: juxtaposed operands multiply.
    let mut with_mul = Vec::with_capacity(out.len());
    for (k, atom) in out.iter().enumerate() {
        if k > 0 && out[k - 1].ends_operand() && atom.starts_operand() {
            with_mul.push(Atom::Op("*"));
        }
        with_mul.push(atom.clone());
    }
    Some(with_mul)
}

/// Names `unicodedata` knows as a Greek small letter are not split.
fn is_greek(name: &str) -> bool {
    [
        "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
        "lamda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi",
        "psi", "omega",
    ]
    .contains(&name.to_lowercase().as_str())
}

#[derive(Debug, Clone)]
enum Expr {
    /// `exact`: an integer literal (sympy's Integer), not a Float.
    Num {
        value: f64,
        exact: bool,
    },
    Sym(String),
    Const(Known),
    Neg(Box<Expr>),
    Bin(&'static str, Box<Expr>, Box<Expr>),
    Call(Known, Box<Expr>),
    Factorial(Box<Expr>),
}

struct Parser {
    atoms: Vec<Atom>,
    i: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Atom> {
        self.atoms.get(self.i)
    }
    fn eat(&mut self, op: &str) -> bool {
        let hit = matches!(self.peek(), Some(Atom::Op(o)) if *o == op);
        self.i += usize::from(hit);
        hit
    }

    fn sum(&mut self) -> Option<Expr> {
        let mut lhs = self.product()?;
        loop {
            let op = if self.eat("+") {
                "+"
            } else if self.eat("-") {
                "-"
            } else {
                return Some(lhs);
            };
            lhs = Expr::Bin(op, Box::new(lhs), Box::new(self.product()?));
        }
    }

    fn product(&mut self) -> Option<Expr> {
        let mut lhs = self.unary()?;
        loop {
            let op = if self.eat("*") {
                "*"
            } else if self.eat("/") {
                "/"
            } else if self.eat("//") {
                // Floor division of sympy numbers: not modelled.
                return None;
            } else {
                return Some(lhs);
            };
            lhs = Expr::Bin(op, Box::new(lhs), Box::new(self.unary()?));
        }
    }

    fn unary(&mut self) -> Option<Expr> {
        if self.eat("-") {
            return Some(Expr::Neg(Box::new(self.unary()?)));
        }
        if self.eat("+") {
            return self.unary();
        }
        self.power()
    }

    fn power(&mut self) -> Option<Expr> {
        let base = self.postfix()?;
        if self.eat("**") {
            // Right-associative, and binds tighter than a unary minus on its left.
            return Some(Expr::Bin("**", Box::new(base), Box::new(self.unary()?)));
        }
        Some(base)
    }

    fn postfix(&mut self) -> Option<Expr> {
        let mut e = self.primary()?;
        while self.eat("!") {
            e = Expr::Factorial(Box::new(e));
        }
        Some(e)
    }

    fn primary(&mut self) -> Option<Expr> {
        let atom = self.peek()?.clone();
        self.i += 1;
        Some(match atom {
            Atom::Num(value, exact) => Expr::Num { value, exact },
            Atom::Sym(s) => Expr::Sym(s),
            Atom::Const(c) => Expr::Const(c),
            Atom::Op("(") => {
                let e = self.sum()?;
                if !self.eat(")") {
                    return None;
                }
                e
            }
            Atom::Fun(f) => {
                // `sqrt(x)`, or implicit application to the next token (`sqrt 2`).
                let arg = if self.eat("(") {
                    let e = self.sum()?;
                    if !self.eat(")") {
                        return None;
                    }
                    e
                } else {
                    self.postfix()?
                };
                Expr::Call(f, Box::new(arg))
            }
            Atom::Op(_) => return None,
        })
    }
}

/// The parsed expression; None where sympy's parse raises or where this port stops.
fn parse(expr: &str) -> Option<Expr> {
    let atoms = atoms(tokenize(&expr.replace('^', "**"))?)?;
    let mut parser = Parser { atoms, i: 0 };
    let e = parser.sum()?;
    (parser.i == parser.atoms.len()).then_some(e)
}

/// Fixed evaluation points for the symbols, in order of appearance (irrational-ish, both signs).
const POINTS: [[f64; 3]; 3] = [
    [0.737_563_1, -1.318_929_7, 2.414_973_3],
    [1.902_143_9, 0.431_078_6, -0.661_342_1],
    [-2.226_701_3, 3.117_549_7, 1.283_640_9],
];

/// One evaluation of the difference. Besides the true values, the difference is evaluated with
/// every square root of a non-square rational and of a symbolic expression negated and π moved:
/// these are field automorphisms (and π is transcendental), so an exact identity stays 0, while
/// a Float that merely approximates an irrational (`1.4142135623730951` against `\sqrt{2}`,
/// `x^{0.5}` against `\sqrt{x}`) no longer cancels — sympy keeps Floats and exact irrationals
/// apart in the same way.
#[derive(Clone, Copy)]
struct Pass {
    conjugate: bool,
    pi: f64,
}

const PASSES: [Pass; 2] = [
    Pass {
        conjugate: false,
        pi: std::f64::consts::PI,
    },
    Pass {
        conjugate: true,
        pi: 2.903_153_1,
    },
];

/// The exact value of a symbol-free, Float-free expression of integers, `+ - * /` and integer
/// powers; None otherwise (or on overflow).
fn rational(e: &Expr) -> Option<(i128, i128)> {
    fn reduce(n: i128, d: i128) -> Option<(i128, i128)> {
        if d == 0 {
            return None;
        }
        let (mut a, mut b) = (n.unsigned_abs(), d.unsigned_abs());
        while b != 0 {
            (a, b) = (b, a % b);
        }
        let g = a.max(1) as i128;
        let sign = if d < 0 { -1 } else { 1 };
        Some((sign * n / g, sign * d / g))
    }
    match e {
        Expr::Num { value, exact } if *exact => Some((*value as i128, 1)),
        Expr::Neg(a) => rational(a).map(|(n, d)| (-n, d)),
        Expr::Bin(op, a, b) => {
            let ((n1, d1), (n2, d2)) = (rational(a)?, rational(b)?);
            match *op {
                "+" => reduce(
                    n1.checked_mul(d2)?.checked_add(n2.checked_mul(d1)?)?,
                    d1.checked_mul(d2)?,
                ),
                "-" => reduce(
                    n1.checked_mul(d2)?.checked_sub(n2.checked_mul(d1)?)?,
                    d1.checked_mul(d2)?,
                ),
                "*" => reduce(n1.checked_mul(n2)?, d1.checked_mul(d2)?),
                "/" => reduce(n1.checked_mul(d2)?, d1.checked_mul(n2)?),
                _ if d2 == 1 && (0..=64).contains(&n2) => {
                    let k = n2 as u32;
                    reduce(n1.checked_pow(k)?, d1.checked_pow(k)?)
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// Whether the square-free part of `n` has an odd number of prime factors (the sign the
/// conjugating pass gives `sqrt(n)`); `n` ≥ 1.
fn odd_squarefree(mut n: u128) -> bool {
    let mut odd = false;
    let mut p = 2u128;
    while p * p <= n {
        if p > 1_000_000 {
            // A large cofactor: one more factor if it is not a square.
            break;
        }
        let mut k = 0;
        while n.is_multiple_of(p) {
            n /= p;
            k += 1;
        }
        odd ^= k % 2 == 1;
        p += 1;
    }
    if n > 1 {
        let r = (n as f64).sqrt().round() as u128;
        if r * r != n {
            odd = !odd;
        }
    }
    odd
}

/// A root of an expression that holds another root or π (`\sqrt{5+2\sqrt{6}}`): its conjugate
/// is not the root of the conjugated argument, so only the true values decide.
fn has_nested_root(e: &Expr) -> bool {
    fn irrational(e: &Expr) -> bool {
        match e {
            Expr::Const(Known::Pi) | Expr::Call(Known::Sqrt, _) => true,
            Expr::Neg(a) | Expr::Call(_, a) | Expr::Factorial(a) => irrational(a),
            Expr::Bin(_, a, b) => irrational(a) || irrational(b),
            _ => false,
        }
    }
    match e {
        Expr::Call(Known::Sqrt, a) => irrational(a) || has_nested_root(a),
        Expr::Neg(a) | Expr::Call(_, a) | Expr::Factorial(a) => has_nested_root(a),
        Expr::Bin(_, a, b) => has_nested_root(a) || has_nested_root(b),
        _ => false,
    }
}

fn has_symbol(e: &Expr) -> bool {
    let mut names = Vec::new();
    symbols(e, &mut names);
    !names.is_empty()
}

fn eval(e: &Expr, vars: &[(String, f64)], pass: Pass) -> Option<(C, f64)> {
    // Returns the value and the largest magnitude of a term met (the scale for "zero").
    Some(match e {
        Expr::Num { value, .. } => (C::real(*value), value.abs()),
        Expr::Sym(s) => {
            let v = vars.iter().find(|(n, _)| n == s)?.1;
            (C::real(v), v.abs())
        }
        Expr::Const(Known::Pi) => (C::real(pass.pi), pass.pi),
        Expr::Const(_) => return None,
        Expr::Neg(a) => {
            let (v, s) = eval(a, vars, pass)?;
            (C::real(0.0).sub(v), s)
        }
        Expr::Bin(op, a, b) => {
            let (x, sx) = eval(a, vars, pass)?;
            let (y, sy) = eval(b, vars, pass)?;
            let v = match *op {
                "+" => x.add(y),
                "-" => x.sub(y),
                "*" => x.mul(y),
                "/" => {
                    if y.abs() == 0.0 {
                        return None; // zoo
                    }
                    x.div(y)
                }
                _ => x.pow(y),
            };
            (v, sx.max(sy).max(v.abs()))
        }
        Expr::Call(f, a) => {
            let (x, s) = eval(a, vars, pass)?;
            let v = match f {
                Known::Sqrt => {
                    let root = x.sqrt();
                    let negate = pass.conjugate
                        && match rational(a) {
                            Some((n, d)) => n
                                .unsigned_abs()
                                .checked_mul(d.unsigned_abs())
                                .is_some_and(odd_squarefree),
                            // sqrt of a Float is a Float in sympy; of a symbol, kept symbolic.
                            None => has_symbol(a),
                        };
                    if negate { C::real(0.0).sub(root) } else { root }
                }
                Known::Ln => {
                    if x.abs() == 0.0 {
                        return None;
                    }
                    x.ln()
                }
                _ => return None,
            };
            (v, s.max(v.abs()))
        }
        Expr::Factorial(a) => {
            let (x, s) = eval(a, vars, pass)?;
            if x.im != 0.0 || x.re < 0.0 || x.re.fract() != 0.0 || x.re > 170.0 {
                return None;
            }
            let v = (1..=x.re as u64).fold(1.0, |acc, k| acc * k as f64);
            (C::real(v), s.max(v))
        }
    })
    .filter(|(v, _)| v.finite())
}

fn symbols(e: &Expr, out: &mut Vec<String>) {
    match e {
        Expr::Sym(s) if !out.contains(s) => out.push(s.clone()),
        Expr::Neg(a) | Expr::Call(_, a) | Expr::Factorial(a) => symbols(a, out),
        Expr::Bin(_, a, b) => {
            symbols(a, out);
            symbols(b, out);
        }
        _ => {}
    }
}

/// `sympy.simplify(parse(expr)) == 0`, decided numerically (see the module notes); false where
/// sympy's parse would raise.
pub fn simplifies_to_zero(expr: &str) -> bool {
    let Some(e) = parse(expr) else {
        return false;
    };
    let mut names = Vec::new();
    symbols(&e, &mut names);
    let points = if names.is_empty() { 1 } else { POINTS.len() };
    let passes = if has_nested_root(&e) {
        &PASSES[..1]
    } else {
        &PASSES[..]
    };
    passes.iter().all(|&pass| {
        (0..points).all(|p| {
            let vars: Vec<(String, f64)> = names
                .iter()
                .enumerate()
                .map(|(k, n)| (n.clone(), POINTS[p][k % 3] + k as f64 * 0.173))
                .collect();
            match eval(&e, &vars, pass) {
                Some((v, scale)) => v.abs() <= 1e-9 * scale.max(1.0),
                None => false,
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::simplifies_to_zero as zero;

    #[test]
    fn parses_like_sympy() {
        // Each left side is what sympy's parse_expr makes of the right (checked in Python).
        assert!(zero("(2*3)-(2 3)"));
        assert!(zero("(0)-(042)"));
        assert!(zero("(2*x+2)-(2(x+1))"));
        assert!(zero("(x*y/2)-(x/2y)"));
        assert!(zero("(120)-(5!)"));
        assert!(zero("(sqrt(2))-(sqrt 2)"));
        assert!(zero("(2*sqrt(3)*x)-(2sqrt(3)x)"));
        assert!(zero("(-(x^2))-(-x^2)"));
        assert!(zero("(x)-(sqrt(x)^2)"));
        assert!(!zero("(x)-(sqrt(x^2))"));
        assert!(zero("(1500000)-(1.5*10^6)"));
        assert!(zero("(sqrt(3)/2)-(3/(2sqrt(3)))"));
        assert!(zero("(2pi)-(pi 2)"));
        assert!(!zero("(0.333)-(1/3)"));
        assert!(!zero("(1/0)-(1/0)"));
        assert!(!zero("(1,2)-(1,2)"));
        assert!(!zero("(x=5)-(5)"));
        assert!(!zero("(oo)-(oo)"));
        // "sqrt2" is a name that splits into s*q*r*t*2.
        assert!(!zero("(sqrt(2))-(sqrt2)"));
        // sympy keeps Floats apart from exact irrationals (checked in Python), and cancels them
        // as coefficients.
        assert!(!zero("(sqrt(2))-(2**0.5)"));
        assert!(!zero("(sqrt(x))-(x**0.5)"));
        assert!(zero("(x**0.5)-(x**0.5)"));
        assert!(zero("(0.5*sqrt(3))-(sqrt(3)/2)"));
        assert!(!zero("(pi)-(3.141592653589793)"));
        assert!(zero("(1.5*x)-(3*x/2)"));
        assert!(!zero("(sqrt(2)/2)-(0.7071067811865476)"));
        assert!(zero("(sqrt(8))-(2sqrt(2))"));
        assert!(zero("(sqrt(6))-(sqrt(2)sqrt(3))"));
        assert!(zero("(2)-(sqrt(2)sqrt(2))"));
        assert!(zero("(sqrt(3)+sqrt(2))-(sqrt(5+2sqrt(6)))"));
    }
}
