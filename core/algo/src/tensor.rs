//! The row-major matrix the algorithms work on.

use super::AlgoError;

/// A `[rows × cols]` f32 matrix, row-major: one row per response, one column per response token.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self, AlgoError> {
        if data.len() != rows * cols {
            return Err(AlgoError::Data {
                rows,
                cols,
                len: data.len(),
            });
        }
        Ok(Self { rows, cols, data })
    }

    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self {
            rows,
            cols,
            data: vec![0.0; rows * cols],
        }
    }

    /// Builds a matrix from equally long rows (handy in tests and for small batches).
    pub fn from_rows(rows: &[&[f32]]) -> Result<Self, AlgoError> {
        let cols = rows.first().map_or(0, |r| r.len());
        let data: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Self::new(rows.len(), cols, data)
    }

    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn data(&self) -> &[f32] {
        &self.data
    }

    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// Per-row sums (verl's `tensor.sum(-1)`), accumulated in f64.
    pub fn row_sums(&self) -> Vec<f64> {
        (0..self.rows)
            .map(|i| self.row(i).iter().map(|&v| f64::from(v)).sum())
            .collect()
    }

    /// Elementwise `f(self, other)`; shapes must match.
    pub fn zip_map(
        &self,
        other: &Matrix,
        what: &'static str,
        f: impl Fn(f32, f32) -> f32,
    ) -> Result<Matrix, AlgoError> {
        other.expect_shape(what, self.shape())?;
        let data = self
            .data
            .iter()
            .zip(&other.data)
            .map(|(&a, &b)| f(a, b))
            .collect();
        Ok(Matrix {
            rows: self.rows,
            cols: self.cols,
            data,
        })
    }

    pub(crate) fn expect_shape(
        &self,
        what: &'static str,
        expected: (usize, usize),
    ) -> Result<(), AlgoError> {
        if self.shape() == expected {
            Ok(())
        } else {
            Err(AlgoError::Shape {
                what,
                expected,
                got: self.shape(),
            })
        }
    }
}

/// Places one score per response on its last response token (verl's reward managers write
/// `reward[i, valid_response_length - 1] = score`); every other entry is zero. The valid length is
/// the number of ones in the row of a left-aligned `response_mask`. A response with no tokens
/// gets no reward (verl would index `-1`, the last padding column).
pub fn place_scores(scores: &[f32], response_mask: &Matrix) -> Result<Matrix, AlgoError> {
    if scores.len() != response_mask.rows() {
        return Err(AlgoError::Length {
            what: "scores",
            expected: response_mask.rows(),
            got: scores.len(),
        });
    }
    let mut out = Matrix::zeros(response_mask.rows(), response_mask.cols());
    for (i, &score) in scores.iter().enumerate() {
        let valid = response_mask.row(i).iter().filter(|&&m| m > 0.0).count();
        if valid > 0 {
            out.row_mut(i)[valid - 1] = score;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_checks_the_data_length() {
        assert_eq!(
            Matrix::new(2, 3, vec![0.0; 5]),
            Err(AlgoError::Data {
                rows: 2,
                cols: 3,
                len: 5
            })
        );
        let m = Matrix::from_rows(&[&[1.0, 2.0], &[3.0, 4.0]]).unwrap();
        assert_eq!(m.row(1), &[3.0, 4.0]);
        assert_eq!(m.row_sums(), vec![3.0, 7.0]);
    }

    #[test]
    fn scores_land_on_the_last_valid_token() {
        let mask =
            Matrix::from_rows(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]).unwrap();
        let placed = place_scores(&[2.0, -1.0, 5.0], &mask).unwrap();
        assert_eq!(
            placed.data(),
            &[0.0, 0.0, 2.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        );
        assert!(matches!(
            place_scores(&[1.0], &mask),
            Err(AlgoError::Length { .. })
        ));
    }
}
