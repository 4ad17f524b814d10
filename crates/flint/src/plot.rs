//! Minimal dependency-free PNG line-chart renderer (used by `flint bench throughput --sweep`).
//!
//! Draws into an RGB buffer with a built-in 5x7 bitmap font, then encodes it as a PNG whose IDAT is a
//! zlib stream made of one fixed-Huffman deflate block (greedy matches at distance 1, 3 and one row).

/// One line on the chart.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart; `log2_x` puts x on a log2 scale with ticks at the data x values.
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log2_x: bool,
    pub series: Vec<Series>,
}

const W: usize = 800;
const H: usize = 500;
/// Font scale factor: glyphs are 5x7, drawn at 10x14 with a 12 px advance.
const S: i64 = 2;
const BLACK: [u8; 3] = [0, 0, 0];
const GRID: [u8; 3] = [225, 225, 225];
const PALETTE: [[u8; 3]; 8] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
];

/// Render `chart` to an 800x500 RGB PNG and return the file bytes.
pub fn render_png(chart: &Chart) -> Vec<u8> {
    let lay = Layout::new(chart);
    let mut c = Canvas { px: vec![255; W * H * 3] };
    let (l, r, t, b) = (lay.left, lay.right, lay.top, lay.bottom);
    for &v in &lay.y.ticks {
        let y = lay.sy(v);
        c.line((l, y), (r, y), GRID, 1);
        c.line((l - 6, y), (l, y), BLACK, 2);
        let s = format!("{:.*}", lay.y.decimals, v);
        c.text(l - 10 - text_width(&s), y - 7, &s, BLACK, false);
    }
    let mut last_right = i64::MIN;
    for &v in &lay.x.ticks {
        let x = lay.sx(v);
        c.line((x, b), (x, b + 6), BLACK, 2);
        let s = format!("{:.*}", lay.x.decimals, v);
        let x0 = x - text_width(&s) / 2;
        if x0 > last_right.saturating_add(6) {
            c.text(x0, b + 12, &s, BLACK, false);
            last_right = x0 + text_width(&s);
        }
    }
    c.line((l, t), (l, b), BLACK, 2);
    c.line((l, b), (r, b), BLACK, 2);
    let pts: Vec<Vec<(i64, i64)>> = chart
        .series
        .iter()
        .map(|s| s.points.iter().filter(|p| valid(p, chart.log2_x)).map(|&p| lay.px(p)).collect())
        .collect();
    let colour = |i: usize| PALETTE[i % PALETTE.len()];
    for (i, p) in pts.iter().enumerate() {
        p.windows(2).for_each(|w| c.line(w[0], w[1], colour(i), 2));
    }
    for (i, p) in pts.iter().enumerate() {
        p.iter().for_each(|&(x, y)| c.disc(x, y, 4, colour(i)));
    }
    for (i, (s, &(lx, ly))) in chart.series.iter().zip(&lay.legend).enumerate() {
        c.line((lx, ly + 7), (lx + 24, ly + 7), colour(i), 2);
        c.disc(lx + 12, ly + 7, 4, colour(i));
        c.text(lx + 30, ly, &s.label, BLACK, false);
    }
    c.text((W as i64 - text_width(&chart.title)) / 2, 12, &chart.title, BLACK, false);
    c.text((l + r - text_width(&chart.x_label)) / 2, H as i64 - 26, &chart.x_label, BLACK, false);
    c.text(10, (t + b + text_width(&chart.y_label)) / 2, &chart.y_label, BLACK, true);
    encode_png(&c.px, W, H)
}

struct Axis {
    lo: f64,
    hi: f64,
    log2: bool,
    ticks: Vec<f64>,
    decimals: usize,
}

impl Axis {
    fn frac(&self, v: f64) -> f64 {
        ((if self.log2 { v.log2() } else { v }) - self.lo) / (self.hi - self.lo)
    }

    /// Linear axis with "nice" (1/2/5 x 10^k) tick steps covering `min..max` (`max > min`).
    fn linear(min: f64, max: f64, headroom: bool) -> Axis {
        let raw = (max - min) / 5.0;
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * mag).find(|s| *s >= raw * 0.999_999);
        let step = step.unwrap_or(10.0 * mag);
        let (lo, mut hi) = ((min / step).floor() * step, (max / step).ceil() * step);
        if headroom && hi <= max {
            hi += step;
        }
        let n = ((hi - lo) / step).round().clamp(1.0, 50.0) as usize;
        let snap = |v: f64| if v.abs() < step * 1e-9 { 0.0 } else { v };
        let ticks = (0..=n).map(|i| snap(lo + i as f64 * step)).collect();
        let decimals = if step >= 1.0 { 0 } else { (-step.log10()).ceil().clamp(0.0, 6.0) as usize };
        Axis { lo, hi, log2: false, ticks, decimals }
    }
}

/// Plot rectangle, axes and legend entry positions for a chart.
struct Layout {
    left: i64,
    right: i64,
    top: i64,
    bottom: i64,
    x: Axis,
    y: Axis,
    legend: Vec<(i64, i64)>,
}

/// Points with non-finite (or absurdly large) coordinates, or x <= 0 on a log2 axis, are skipped.
fn valid(p: &(f64, f64), log2_x: bool) -> bool {
    let ok = |v: f64| v.is_finite() && v.abs() < 1e12;
    ok(p.0) && ok(p.1) && (!log2_x || p.0 > 0.0)
}

impl Layout {
    fn new(chart: &Chart) -> Layout {
        let (left, right, bottom) = (110, W as i64 - 30, H as i64 - 70);
        let (mut lx, mut ly, mut legend) = (left, 40, Vec::new());
        for s in &chart.series {
            let w = 54 + text_width(&s.label);
            if lx + w > W as i64 - 20 && lx > left {
                (lx, ly) = (left, ly + 22);
            }
            legend.push((lx, ly));
            lx += w;
        }
        let top = if legend.is_empty() { 44 } else { (ly + 32).min(bottom - 60) };
        let pts: Vec<(f64, f64)> =
            chart.series.iter().flat_map(|s| s.points.iter().filter(|p| valid(p, chart.log2_x)).copied()).collect();
        let (xmin, xmax) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let ymax = pts.iter().fold(0.0f64, |a, p| a.max(p.1));
        let ymin = pts.iter().fold(0.0f64, |a, p| a.min(p.1));
        let y = Axis::linear(ymin, if ymax - ymin < 1e-9 { ymin + 1.0 } else { ymax }, true);
        let x = if chart.log2_x {
            let mut ticks: Vec<f64> = pts.iter().map(|p| p.0).collect();
            ticks.sort_by(f64::total_cmp);
            ticks.dedup();
            if ticks.is_empty() {
                ticks = vec![1.0, 2.0];
            }
            let (mut lo, mut hi) = (ticks[0].log2(), ticks[ticks.len() - 1].log2());
            if hi - lo < 1e-9 {
                (lo, hi) = (lo - 1.0, hi + 1.0);
            }
            let pad = (hi - lo) * 0.05;
            let decimals = if ticks.iter().all(|v| v.fract() == 0.0) { 0 } else { 2 };
            Axis { lo: lo - pad, hi: hi + pad, log2: true, ticks, decimals }
        } else if pts.is_empty() {
            Axis::linear(0.0, 1.0, false)
        } else if xmax - xmin < 1e-9 {
            Axis::linear(xmin - 1.0, xmax + 1.0, false)
        } else {
            Axis::linear(xmin, xmax, false)
        };
        Layout { left, right, top, bottom, x, y, legend }
    }

    fn sx(&self, x: f64) -> i64 {
        let v = self.left as f64 + self.x.frac(x) * (self.right - self.left) as f64;
        v.round().clamp(-10.0, W as f64 + 10.0) as i64
    }

    fn sy(&self, y: f64) -> i64 {
        let v = self.bottom as f64 - self.y.frac(y) * (self.bottom - self.top) as f64;
        v.round().clamp(-10.0, H as f64 + 10.0) as i64
    }

    fn px(&self, (x, y): (f64, f64)) -> (i64, i64) {
        (self.sx(x), self.sy(y))
    }
}

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: [u8; 3]) {
        for yy in y.max(0)..(y + h).min(H as i64) {
            for xx in x.max(0)..(x + w).min(W as i64) {
                let i = (yy as usize * W + xx as usize) * 3;
                self.px[i..i + 3].copy_from_slice(&c);
            }
        }
    }

    /// Bresenham line, stamping a `th`x`th` square at each step.
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: [u8; 3], th: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.rect(x - th / 2, y - th / 2, th, th, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    fn disc(&mut self, cx: i64, cy: i64, r: i64, c: [u8; 3]) {
        for dy in -r..=r {
            for dx in -r..=r {
                if dx * dx + dy * dy <= r * r + r {
                    self.rect(cx + dx, cy + dy, 1, 1, c);
                }
            }
        }
    }

    /// Draw `s` with its top-left at (x, y); `vertical` rotates 90° CCW with (x, y) the bottom-left.
    fn text(&mut self, x: i64, y: i64, s: &str, c: [u8; 3], vertical: bool) {
        for (i, ch) in s.chars().enumerate() {
            for (gy, row) in glyph(ch).iter().enumerate() {
                for gx in (0..5).filter(|gx| row >> (4 - gx) & 1 == 1) {
                    let (u, v) = ((i as i64 * 6 + gx) * S, gy as i64 * S);
                    if vertical {
                        self.rect(x + v, y - u - S, S, S, c);
                    } else {
                        self.rect(x + u, y + v, S, S, c);
                    }
                }
            }
        }
    }
}

fn text_width(s: &str) -> i64 {
    (s.chars().count() as i64 * 6 * S - S).max(0)
}

fn glyph(ch: char) -> [u8; 7] {
    FONT.iter().find(|(k, _)| *k == ch).map_or([0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F], |(_, g)| *g)
}

fn encode_png(px: &[u8], w: usize, h: usize) -> Vec<u8> {
    let stride = w * 3 + 1;
    let mut raw = Vec::with_capacity(stride * h);
    for row in px.chunks(w * 3) {
        raw.push(0); // filter type: None
        raw.extend_from_slice(row);
    }
    let mut z = vec![0x78, 0x01];
    z.extend(deflate_fixed(&raw, stride));
    z.extend(adler32(&raw).to_be_bytes());
    let mut ihdr = Vec::with_capacity(13);
    ihdr.extend((w as u32).to_be_bytes());
    ihdr.extend((h as u32).to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]); // 8-bit RGB, deflate, adaptive filtering, no interlace
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    for (kind, data) in [(b"IHDR", &ihdr), (b"IDAT", &z), (b"IEND", &Vec::new())] {
        out.extend((data.len() as u32).to_be_bytes());
        let start = out.len();
        out.extend(kind);
        out.extend(data);
        let crc = crc32(&out[start..]);
        out.extend(crc.to_be_bytes());
    }
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

fn adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for chunk in data.chunks(5552) {
        for &x in chunk {
            a += x as u32;
            b += a;
        }
        (a, b) = (a % 65521, b % 65521);
    }
    (b << 16) | a
}

const LEN_BASE: [u16; 29] =
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258];
const DIST_BASE: [u16; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097, 6145,
    8193, 12289, 16385, 24577,
];

fn len_extra(i: usize) -> u32 {
    if (8..28).contains(&i) {
        (i as u32 - 4) / 4
    } else {
        0
    }
}

fn dist_extra(i: usize) -> u32 {
    if i < 4 {
        0
    } else {
        i as u32 / 2 - 1
    }
}

#[derive(Default)]
struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl BitWriter {
    fn put(&mut self, v: u32, n: u32) {
        self.acc |= (v as u64) << self.n;
        self.n += n;
        while self.n >= 8 {
            self.out.push(self.acc as u8);
            (self.acc, self.n) = (self.acc >> 8, self.n - 8);
        }
    }

    /// Huffman codes go into the stream most-significant bit first.
    fn code(&mut self, code: u32, len: u32) {
        self.put(code.reverse_bits() >> (32 - len), len);
    }

    fn symbol(&mut self, sym: u32) {
        match sym {
            0..=143 => self.code(0x30 + sym, 8),
            144..=255 => self.code(0x190 + sym - 144, 9),
            256..=279 => self.code(sym - 256, 7),
            _ => self.code(0xC0 + sym - 280, 8),
        }
    }
}

/// One final fixed-Huffman deflate block; greedy matches against the previous byte, pixel and row.
fn deflate_fixed(data: &[u8], stride: usize) -> Vec<u8> {
    let mut bw = BitWriter::default();
    bw.put(1, 1); // BFINAL
    bw.put(1, 2); // BTYPE = 01 (fixed Huffman)
    let mut i = 0;
    while i < data.len() {
        let (mut len, mut dist) = (0, 0);
        for d in [1, 3, stride].into_iter().filter(|&d| d <= i && d <= 32768) {
            let l = (0..(data.len() - i).min(258)).take_while(|&k| data[i + k] == data[i + k - d]).count();
            if l > len {
                (len, dist) = (l, d);
            }
        }
        if len >= 3 {
            let li = LEN_BASE.iter().rposition(|&b| b as usize <= len).unwrap_or(0);
            bw.symbol(257 + li as u32);
            bw.put((len - LEN_BASE[li] as usize) as u32, len_extra(li));
            let di = DIST_BASE.iter().rposition(|&b| b as usize <= dist).unwrap_or(0);
            bw.code(di as u32, 5);
            bw.put((dist - DIST_BASE[di] as usize) as u32, dist_extra(di));
            i += len;
        } else {
            bw.symbol(data[i] as u32);
            i += 1;
        }
    }
    bw.symbol(256);
    if bw.n > 0 {
        bw.out.push(bw.acc as u8);
    }
    bw.out
}

/// 5x7 glyphs: seven rows top to bottom, bit 4 is the leftmost column.
#[rustfmt::skip]
const FONT: [(char, [u8; 7]); 74] = [
    (' ', [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]), ('.', [0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C]),
    (',', [0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08]), ('-', [0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00]),
    ('/', [0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00]), ('(', [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02]),
    (')', [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08]), (':', [0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00]),
    ('%', [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03]), ('_', [0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F]),
    ('+', [0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00]), ('=', [0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00]),
    ('0', [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E]), ('1', [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E]),
    ('2', [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F]), ('3', [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E]),
    ('4', [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02]), ('5', [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E]),
    ('6', [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E]), ('7', [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08]),
    ('8', [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E]), ('9', [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C]),
    ('A', [0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11]), ('B', [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E]),
    ('C', [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E]), ('D', [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C]),
    ('E', [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F]), ('F', [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10]),
    ('G', [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F]), ('H', [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11]),
    ('I', [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E]), ('J', [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C]),
    ('K', [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11]), ('L', [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F]),
    ('M', [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11]), ('N', [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11]),
    ('O', [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E]), ('P', [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10]),
    ('Q', [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D]), ('R', [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11]),
    ('S', [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E]), ('T', [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04]),
    ('U', [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E]), ('V', [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04]),
    ('W', [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A]), ('X', [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11]),
    ('Y', [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04]), ('Z', [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F]),
    ('a', [0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F]), ('b', [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E]),
    ('c', [0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E]), ('d', [0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F]),
    ('e', [0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E]), ('f', [0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08]),
    ('g', [0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E]), ('h', [0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11]),
    ('i', [0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E]), ('j', [0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C]),
    ('k', [0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12]), ('l', [0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E]),
    ('m', [0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11]), ('n', [0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11]),
    ('o', [0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E]), ('p', [0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10]),
    ('q', [0x00, 0x00, 0x0D, 0x13, 0x0F, 0x01, 0x01]), ('r', [0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10]),
    ('s', [0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E]), ('t', [0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06]),
    ('u', [0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D]), ('v', [0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04]),
    ('w', [0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A]), ('x', [0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11]),
    ('y', [0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E]), ('z', [0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F]),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Chart {
        let pts = |k: f64| [1.0, 2.0, 4.0, 8.0, 16.0, 32.0].iter().map(|&c: &f64| (c, k * c.sqrt())).collect();
        Chart {
            title: "Throughput vs concurrency".into(),
            x_label: "concurrency (log2)".into(),
            y_label: "tokens/s".into(),
            log2_x: true,
            series: vec![
                Series { label: "decode".into(), points: pts(100.0) },
                Series { label: "prefill+decode".into(), points: pts(400.0) },
            ],
        }
    }

    /// Split a PNG into (type, data) chunks, asserting the signature and every chunk CRC.
    fn chunks(png: &[u8]) -> Vec<([u8; 4], Vec<u8>)> {
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let (mut out, mut i) = (Vec::new(), 8);
        while i < png.len() {
            let len = u32::from_be_bytes(png[i..i + 4].try_into().unwrap()) as usize;
            let body = &png[i + 4..i + 8 + len];
            let crc = u32::from_be_bytes(png[i + 8 + len..i + 12 + len].try_into().unwrap());
            assert_eq!(crc32(body), crc, "bad CRC on chunk {:?}", String::from_utf8_lossy(&body[..4]));
            out.push((body[..4].try_into().unwrap(), body[4..].to_vec()));
            i += 12 + len;
        }
        out
    }

    // Deflate extra-bit counts (RFC 1951 3.2.5), written out independently of the encoder's helpers.
    const LEN_EXTRA: [u32; 29] =
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0];
    const DIST_EXTRA: [u32; 30] =
        [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13];

    #[test]
    fn deflate_tables_match_rfc1951() {
        for (i, &e) in LEN_EXTRA.iter().enumerate() {
            assert_eq!(len_extra(i), e, "length code {i}");
        }
        for i in 0..27 {
            assert_eq!(LEN_BASE[i] as u32 + (1 << LEN_EXTRA[i]), LEN_BASE[i + 1] as u32, "length base {i}");
        }
        for (i, &e) in DIST_EXTRA.iter().enumerate() {
            assert_eq!(dist_extra(i), e, "distance code {i}");
        }
        for i in 0..29 {
            assert_eq!(DIST_BASE[i] as u32 + (1 << DIST_EXTRA[i]), DIST_BASE[i + 1] as u32, "distance base {i}");
        }
        assert_eq!(LEN_BASE[28], 258);
    }

    /// Inflate a zlib stream made of fixed-Huffman blocks (all that `deflate_fixed` emits).
    fn inflate(z: &[u8]) -> Vec<u8> {
        assert_eq!(((z[0] as u32) << 8 | z[1] as u32) % 31, 0, "zlib header check");
        let mut pos = 16; // bit position, past the 2-byte header
        let mut bit = || {
            let b = (z[pos / 8] >> (pos % 8)) & 1;
            pos += 1;
            b as u32
        };
        let mut out: Vec<u8> = Vec::new();
        loop {
            let last = bit();
            assert_eq!(bit() | bit() << 1, 1, "expected a fixed-Huffman block");
            loop {
                let mut code = (0..7).fold(0, |c, _| c << 1 | bit());
                let sym = if code < 24 {
                    256 + code
                } else {
                    code = code << 1 | bit();
                    match code {
                        0x30..=0xBF => code - 0x30,
                        0xC0..=0xC7 => 280 + code - 0xC0,
                        _ => 144 + (code << 1 | bit()) - 0x190,
                    }
                };
                let extra = |n: u32, bit: &mut dyn FnMut() -> u32| (0..n).fold(0, |v, k| v | bit() << k) as usize;
                match sym {
                    0..=255 => out.push(sym as u8),
                    256 => break,
                    _ => {
                        let li = sym as usize - 257;
                        let len = LEN_BASE[li] as usize + extra(LEN_EXTRA[li], &mut bit);
                        let di = (0..5).fold(0, |c, _| c << 1 | bit()) as usize;
                        let dist = DIST_BASE[di] as usize + extra(DIST_EXTRA[di], &mut bit);
                        for _ in 0..len {
                            out.push(out[out.len() - dist]);
                        }
                    }
                }
            }
            if last == 1 {
                break;
            }
        }
        let tail = &z[pos.div_ceil(8)..];
        assert_eq!(tail, adler32(&out).to_be_bytes(), "adler32 trailer");
        out
    }

    /// Decode a rendered PNG to its raw RGB pixels (filter bytes checked and stripped).
    fn decode(png: &[u8]) -> Vec<u8> {
        let ch = chunks(png);
        let kinds: Vec<&[u8; 4]> = ch.iter().map(|c| &c.0).collect();
        assert_eq!(kinds, [b"IHDR", b"IDAT", b"IEND"]);
        let mut ihdr = (W as u32).to_be_bytes().to_vec();
        ihdr.extend((H as u32).to_be_bytes());
        ihdr.extend([8, 2, 0, 0, 0]);
        assert_eq!(ch[0].1, ihdr);
        let raw = inflate(&ch[1].1);
        assert_eq!(raw.len(), H * (W * 3 + 1));
        raw.chunks(W * 3 + 1)
            .flat_map(|row| {
                assert_eq!(row[0], 0, "filter byte");
                row[1..].to_vec()
            })
            .collect()
    }

    fn pixel(px: &[u8], (x, y): (i64, i64)) -> [u8; 3] {
        let i = (y as usize * W + x as usize) * 3;
        [px[i], px[i + 1], px[i + 2]]
    }

    #[test]
    fn crc32_matches_known_iend_value() {
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(adler32(b"Wikipedia"), 0x11E6_0398);
    }

    #[test]
    fn png_has_valid_chunks_and_full_idat() {
        let png = render_png(&sample());
        assert_eq!(&png[png.len() - 12..], [0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xAE, 0x42, 0x60, 0x82]);
        assert_eq!(decode(&png).len(), W * H * 3);
        assert!(png.len() < 100_000, "compression is working: {} bytes", png.len());
    }

    #[test]
    fn data_points_have_series_colours_and_background_is_white() {
        let chart = sample();
        let px = decode(&render_png(&chart));
        let lay = Layout::new(&chart);
        for (i, s) in chart.series.iter().enumerate() {
            for &p in &s.points {
                assert_eq!(pixel(&px, lay.px(p)), PALETTE[i], "series {i} point {p:?}");
            }
        }
        assert_eq!(pixel(&px, (0, 0)), [255; 3]);
        assert_eq!(pixel(&px, (W as i64 - 1, H as i64 - 1)), [255; 3]);
        assert_ne!(PALETTE[0], PALETTE[1]);
    }

    #[test]
    fn nice_y_axis_starts_at_zero_and_exceeds_max() {
        let lay = Layout::new(&sample());
        let max = 400.0 * 32f64.sqrt();
        assert_eq!(lay.y.ticks[0], 0.0);
        assert!(lay.y.hi > max && *lay.y.ticks.last().unwrap() > max, "{:?}", lay.y.ticks);
        assert_eq!(lay.x.ticks, [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]);
        let exact = Axis::linear(0.0, 1000.0, true); // max on a tick still gets headroom
        assert_eq!((exact.lo, exact.hi, exact.ticks.len()), (0.0, 1200.0, 7));
        let step = lay.y.ticks[1];
        assert!([1.0, 2.0, 5.0].iter().any(|m| (step / 10f64.powf(step.log10().floor()) - m).abs() < 1e-9));
    }

    #[test]
    fn font_covers_required_characters() {
        let boxed = glyph('\u{2603}');
        for ch in ('0'..='9').chain('a'..='z').chain('A'..='Z').chain(" .,-/():%_".chars()) {
            assert_ne!(glyph(ch), boxed, "missing glyph {ch:?}");
        }
    }

    #[test]
    fn degenerate_charts_render() {
        let chart = |log2_x, points: Vec<(f64, f64)>| Chart {
            title: "é~{}".into(),
            x_label: String::new(),
            y_label: String::new(),
            log2_x,
            series: vec![Series { label: "x".repeat(200), points }],
        };
        let cases = [
            vec![],
            vec![(4.0, 10.0)],
            vec![(1.0, 0.0), (2.0, 0.0), (4.0, 0.0)],
            vec![(f64::NAN, 1.0), (2.0, f64::NAN), (f64::INFINITY, 3.0), (4.0, -f64::INFINITY), (8.0, 5.0)],
            vec![(0.0, 1.0), (-2.0, 3.0), (1e300, 1e300), (5e-324, -1.0)],
            vec![(3.0, 1e-12), (3.0, 2e-12)],
        ];
        for log2_x in [true, false] {
            for pts in &cases {
                let c = chart(log2_x, pts.clone());
                let lay = Layout::new(&c);
                for a in [&lay.x, &lay.y] {
                    assert!(a.hi > a.lo && !a.ticks.is_empty(), "log2={log2_x} {pts:?}");
                    assert!(a.ticks.iter().all(|t| t.is_finite() && (!a.log2 || *t > 0.0)), "{:?}", a.ticks);
                }
                assert_eq!(decode(&render_png(&c)).len(), W * H * 3, "log2={log2_x} {pts:?}");
            }
        }
        let empty = Chart { series: vec![], ..chart(true, vec![]) };
        let px = decode(&render_png(&empty));
        assert_eq!(pixel(&px, (0, 0)), [255; 3]);
        let many =
            Chart { series: (0..40).map(|i| Series { label: format!("s{i}"), points: vec![] }).collect(), ..empty };
        assert_eq!(decode(&render_png(&many)).len(), W * H * 3);
    }
}
