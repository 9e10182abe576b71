include!("engine/mlx-sys/link_args.rs");

fn main() {
    forward_mlx_link_args();
}
