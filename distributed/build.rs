//! Compiles the c10d shim (csrc/shim.cpp) against the libtorch that torch-sys links, and embeds
//! libtorch's library folder as an rpath. Flags as measured in DESIGN §8: without USE_C10D_GLOO
//! ProcessGroupGloo.hpp is silently empty; the wheel lacks gloo's own headers, so
//! csrc/gloo-stand-in declares the few gloo types c10d's headers name.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=VERL_NCCL_INCLUDE");
    println!("cargo:rerun-if-env-changed=VERL_CUDA_INCLUDE");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    // As torch-sys: the wheels since PyTorch 2.7 use the C++11 ABI.
    let cxx11_abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    // Exported by torch-sys through its `links = "tch"` key: <libtorch>/lib.
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys exports DEP_TCH_LIBTORCH_LIB (libtorch's lib folder)"),
    );
    let root = lib.parent().expect("libtorch's lib folder has a parent");
    let include = root.join("include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("csrc/shim.cpp")
        .include("csrc/gloo-stand-in")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", cxx11_abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        .define("USE_DISTRIBUTED", None)
        .define("USE_C10D_GLOO", None)
        // libtorch's own headers trip these; they are not ours to fix.
        .flag_if_supported("-Wno-c++20-extensions")
        .flag_if_supported("-Wno-unused-parameter");
    if std::env::var_os("CARGO_FEATURE_NCCL").is_some() {
        build
            .define("VERL_DIST_NCCL", None)
            .define("USE_C10D_NCCL", None)
            .define("USE_CUDA", None);
        for var in ["VERL_NCCL_INCLUDE", "VERL_CUDA_INCLUDE"] {
            if let Some(dir) = std::env::var_os(var) {
                build.include(dir);
            }
        }
        println!("cargo:rustc-link-lib=torch_cuda");
    }
    build.compile("verl_dist_shim");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}
