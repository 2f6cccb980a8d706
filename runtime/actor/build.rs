//! Embeds libtorch's library folder as an rpath so that tests and binaries linking this crate run
//! without LD_LIBRARY_PATH.
fn main() {
    // Exported by torch-sys through its `links = "tch"` key.
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
}
